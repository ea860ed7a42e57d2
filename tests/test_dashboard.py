"""The dashboard (``/ui``) and the OpenAPI page (``/docs``) in headless Chromium (Debian's
``chromium`` and ``chromium-driver``, installed by scripts/setup.sh --dev) against a real daemon on
the cpu backend: during a training job the loss curve moves and the step count grows; the
Swagger page renders from the package's own files; a page's POST reaches the daemon from its own
origin and is refused from another one (docs/service.md, "Security").

``MMAD_DASHBOARD_SCREENSHOT=PATH`` saves the page's screenshot during the job there
(docs/dashboard.png was made so).
"""

from __future__ import annotations

import io
import os
import shutil
import time

import httpx
import numpy as np
import pytest
from conftest import DaemonProcess
from safetensors.numpy import save as st_save

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (scripts/setup.sh --dev)")
from PIL import Image, ImageChops  # noqa: E402
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    proc = DaemonProcess(tmp_path_factory.mktemp("ui") / "store").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("chromium cannot start: chromium or chromedriver is not installed "
                    "(Debian: apt-get install chromium chromium-driver; scripts/setup.sh --dev does)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--hide-scrollbars"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=webdriver.ChromeService(driver_path), options=options)
    except WebDriverException as exc:
        pytest.skip(f"chromium cannot start: {exc.msg}")
    yield driver
    driver.quit()


def canvas_image(browser) -> Image.Image:
    return Image.open(io.BytesIO(browser.find_element(By.CSS_SELECTOR, ".job canvas").screenshot_as_png)).convert("RGB")


def shown_step(browser) -> int:
    return int(browser.find_element(By.CSS_SELECTOR, ".job .step").text)


def test_dashboard_shows_devices_models_and_a_moving_loss_curve(daemon, browser):
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (4096, 2)).astype(np.float32)
    y = np.stack([np.sin(6 * x[:, 0]), np.cos(5 * x[:, 1]), x.prod(1)], 1).astype(np.float32)
    with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
        dataset = http.post("/v2/models/demo/datasets", content=st_save({"x": x, "y": y})).json()["dataset"]
        r = http.post("/v2/models/demo/jobs", json={"dataset": dataset, "steps": 10_000_000, "batch_size": 256,
                                                    "checkpoint_every": 5000, "seed": 1})
        assert r.status_code == 202, r.text
        job = r.json()["job"]
        try:
            browser.get(f"{daemon.url}/ui")
            wait = WebDriverWait(browser, 20)
            wait.until(lambda b: "cpu:numpy" in b.find_element(By.ID, "devices").text)
            wait.until(lambda b: "demo" in b.find_element(By.ID, "models").text)
            assert "READY" in browser.find_element(By.ID, "models").text
            # the curve needs two progress events (about 5 a second)
            wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".job .step") and shown_step(b) > 0)
            time.sleep(1.0)
            first, first_step = canvas_image(browser), shown_step(browser)
            time.sleep(1.2)
            second, second_step = canvas_image(browser), shown_step(browser)
            assert second_step > first_step, (first_step, second_step)
            changed = ImageChops.difference(first, second).getbbox()
            assert changed is not None, "the loss curve did not change in 1.2 s of training"
            diff = np.asarray(ImageChops.difference(first, second).convert("L"))
            assert (diff > 32).sum() > 50, "only a few pixels of the curve changed"
            assert job[:8] in browser.find_element(By.CSS_SELECTOR, ".job h3").text
            assert browser.find_element(By.ID, "error").get_attribute("hidden") is not None
            if os.environ.get("MMAD_DASHBOARD_SCREENSHOT"):
                browser.save_screenshot(os.environ["MMAD_DASHBOARD_SCREENSHOT"])
        finally:
            http.delete(f"/v2/models/demo/jobs/{job}")
        WebDriverWait(browser, 20).until(lambda b: "cancelled" in b.find_element(By.CSS_SELECTOR, ".job .state").text)


def test_swagger_page_renders_from_local_files(daemon, browser):
    html = httpx.get(f"{daemon.url}/docs").text
    assert "/static/swagger/swagger-ui-bundle.js" in html and "cdn" not in html.lower()
    browser.get(f"{daemon.url}/docs")
    WebDriverWait(browser, 20).until(lambda b: b.find_elements(By.CSS_SELECTOR, ".swagger-ui .info .title"))
    assert "mmad" in browser.find_element(By.CSS_SELECTOR, ".swagger-ui .info .title").text
    assert browser.find_elements(By.CSS_SELECTOR, ".opblock-tag")  # the routes, from /openapi.json
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(url.startswith(daemon.url) for url in loaded), loaded
    assert httpx.get(f"{daemon.url}/redoc").status_code == 404  # no local copy of ReDoc: not served


FETCH = """const [url, options, done] = arguments;
fetch(url, options).then(r => done(r.type === "opaque" ? "opaque" : r.status), e => done("error: " + e));"""


def test_a_page_writes_from_the_daemons_origin_and_not_from_another(daemon, browser):
    """Chromium's own requests, Origin and all: the dashboard's origin (127.0.0.1:port) may take a
    checkpoint; a page of another origin (localhost:port, another host name) sends the form-like
    POST that needs no preflight, and nothing is written."""
    with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
        count = lambda: len(http.get("/v2/models/demo/versions").json()["versions"])  # noqa: E731
        before = count()
        browser.get(f"{daemon.url}/ui")
        status = browser.execute_async_script(FETCH, "/v2/models/demo/versions", {"method": "POST"})
        assert status == 200 and count() == before + 1, status
        browser.get(f"http://localhost:{daemon.port}/ui")
        for body_type in ("text/plain", "application/x-www-form-urlencoded"):
            status = browser.execute_async_script(FETCH, f"{daemon.url}/v2/models/demo/versions", {
                "method": "POST", "mode": "no-cors", "headers": {"Content-Type": body_type}, "body": "{}"})
            assert status == "opaque", status  # sent; the answer is the browser's to hide
        status = browser.execute_async_script(FETCH, f"{daemon.url}/v2/models/demo/versions", {"method": "POST"})
        assert status.startswith("error"), status  # no CORS header: the page reads nothing either
        assert count() == before + 1
