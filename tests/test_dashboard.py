"""The dashboard (``/ui``) and the OpenAPI page (``/docs``) in headless Chromium (Debian's
``chromium`` and ``chromium-driver``, installed by scripts/setup.sh --dev) against a real daemon on
the cpu backend: during a training job the loss curve moves and the step count grows; a reloaded
page draws the job's curve from its first step (the daemon's history); the request charts show
latency, rate and errors from /metrics; unavailable backends are folded away with their reasons;
the Swagger page renders from the package's own files; a page's POST reaches the daemon from its
own origin and is refused from another one (docs/service.md, "Security").

``MMAD_DASHBOARD_SCREENSHOT=PATH`` saves there the whole page, its request charts filled while a
training job runs (docs/dashboard.png was made so).
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
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # every backend probed (the daemon runs on cpu): the unavailable ones are the folded list
    proc = DaemonProcess(tmp_path_factory.mktemp("ui") / "store", env={"MMAD_PROBE": "all"}).start()
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


def training_data(rng) -> bytes:
    x = rng.uniform(0, 1, (4096, 2)).astype(np.float32)
    y = np.stack([np.sin(6 * x[:, 0]), np.cos(5 * x[:, 1]), x.prod(1)], 1).astype(np.float32)
    return st_save({"x": x, "y": y})


def chart_pixels(browser, selector: str, rgb: tuple[int, int, int], columns: slice = slice(None)) -> int:
    """Pixels of about colour ``rgb`` in the canvas ``selector`` (within ``columns``)."""
    image = Image.open(io.BytesIO(browser.find_element(By.CSS_SELECTOR, selector).screenshot_as_png))
    pixels = np.asarray(image.convert("RGB"), np.int32)[:, columns]
    return int((np.abs(pixels - np.array(rgb)).max(axis=2) < 40).sum())


CURVE_BLUE = (0x25, 0x63, 0xEB)
ERROR_RED = (0xDC, 0x26, 0x26)


def counted(http, family: str) -> int:
    """The sum of a counter family's series in /metrics, read by Prometheus's own parser."""
    families = text_string_to_metric_families(http.get("/metrics").text)
    return int(sum(s.value for f in families if f.name == family for s in f.samples if s.name == f"{family}_total"))


# first in the file: its job trains the demo model from its first weights, the curve the screenshot shows
def test_request_charts_show_latency_rate_and_errors(daemon, browser):
    rng = np.random.default_rng(4)
    with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
        dataset = http.post("/v2/models/demo/datasets", content=training_data(rng)).json()["dataset"]
        r = http.post("/v2/models/demo/jobs", json={"dataset": dataset, "steps": 10_000_000, "batch_size": 256,
                                                    "checkpoint_every": 5_000_000, "seed": 5})
        assert r.status_code == 202, r.text
        job = f"/v2/models/demo/jobs/{r.json()['job']}"
        try:
            serve_and_check_the_charts(http, browser, daemon.url, rng)
        finally:
            http.delete(job)
            deadline = time.monotonic() + 20  # the next test's job needs the model free
            while http.get(job).json()["state"] not in ("done", "cancelled", "failed"):
                assert time.monotonic() < deadline
                time.sleep(0.05)


def serve_and_check_the_charts(http, browser, url, rng):
    """Infers (one of them bad) while a job trains, then the charts' data and pixels."""
    browser.get(f"{url}/ui")
    wait = WebDriverWait(browser, 20)
    wait.until(lambda b: b.find_element(By.ID, "requests-total").text.isdigit())  # the first scrape
    for i in range(30):  # over about three of the page's scrapes
        x = rng.uniform(0, 1, (16, 2)).astype(np.float32)
        r = http.post("/v2/models/demo/infer", json={"inputs": [
            {"name": "INPUT", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]})
        assert r.status_code == 200, r.text
        if i == 10:  # a row of three values for a model of two inputs
            bad = http.post("/v2/models/demo/infer", json={"inputs": [
                {"name": "INPUT", "datatype": "FP32", "shape": [1, 3], "data": [0.1, 0.2, 0.3]}]})
            assert bad.status_code == 400, bad.text
        time.sleep(0.1)
    errors, requests = counted(http, "mmad_request_failures"), counted(http, "mmad_requests")
    assert errors >= 1 and requests >= 31

    def value(b, chart: str, attribute: str) -> float:
        text = b.find_element(By.ID, chart).get_attribute(attribute)
        return float(text) if text else 0.0

    wait.until(lambda b: value(b, "latency-chart", "data-points") > 0 and value(b, "requests-chart", "data-max") > 0
               and value(b, "errors-chart", "data-max") > 0)
    wait.until(lambda b: b.find_element(By.ID, "errors-total").text.split()[0] == str(errors)
               and b.find_element(By.ID, "requests-total").text == str(requests))
    assert "400: " in browser.find_element(By.ID, "errors-total").text
    # at most 30 good infers and one bad in a scrape's interval of about a second
    assert value(browser, "requests-chart", "data-max") <= 31 / 0.5
    assert chart_pixels(browser, "#latency-chart", CURVE_BLUE) > 10
    assert chart_pixels(browser, "#requests-chart", CURVE_BLUE) > 10
    assert chart_pixels(browser, "#errors-chart", ERROR_RED) > 10
    if os.environ.get("MMAD_DASHBOARD_SCREENSHOT"):
        browser.set_window_size(1280, browser.execute_script("return document.body.scrollHeight") + 140)
        shot = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
        shot.quantize(128).save(os.environ["MMAD_DASHBOARD_SCREENSHOT"], optimize=True)  # a third of the bytes
        browser.set_window_size(1280, 1000)


def test_dashboard_shows_devices_models_and_a_moving_loss_curve(daemon, browser):
    with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
        dataset = http.post("/v2/models/demo/datasets", content=training_data(np.random.default_rng(0))).json()["dataset"]
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
        finally:
            http.delete(f"/v2/models/demo/jobs/{job}")
        WebDriverWait(browser, 20).until(lambda b: "cancelled" in b.find_element(By.CSS_SELECTOR, ".job .state").text)


def test_a_reloaded_page_draws_the_loss_curve_from_the_jobs_first_step(daemon, browser):
    with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
        dataset = http.post("/v2/models/demo/datasets", content=training_data(np.random.default_rng(2))).json()
        r = http.post("/v2/models/demo/jobs", json={"dataset": dataset["dataset"], "steps": 10_000_000,
                                                    "batch_size": 256, "checkpoint_every": 5_000_000, "seed": 3})
        assert r.status_code == 202, r.text
        job = r.json()["job"]
        losses = f"/v2/models/demo/jobs/{job}/losses"
        try:
            browser.get(f"{daemon.url}/ui")
            card = f'.job[data-job="{job}"]'
            WebDriverWait(browser, 20).until(lambda b: b.find_elements(By.CSS_SELECTOR, card))
            deadline = time.monotonic() + 30
            while len(before := http.get(losses).json()["points"]) < 8:  # a few chunks
                assert time.monotonic() < deadline, before
                time.sleep(0.1)
            browser.refresh()
            canvas = f"{card} canvas"
            WebDriverWait(browser, 20).until(
                lambda b: b.find_elements(By.CSS_SELECTOR, canvas)
                and b.find_element(By.CSS_SELECTOR, canvas).get_attribute("data-first"))
            history = http.get(losses).json()
            drawn = browser.execute_script("return jobs.get(arguments[0]).points", job)
            # the first chunk is one step: the history starts there, and so does the reloaded page
            assert history["points"][0][0] == 1 and drawn[0] == history["points"][0], (drawn[:3], history["points"][:3])
            assert int(browser.find_element(By.CSS_SELECTOR, canvas).get_attribute("data-first")) == 1
            # every point the daemon had before the reload is on the page, as the daemon has it now
            # (a thousand points hold the whole of this job unmerged)
            known = before[-1][0]
            assert [p for p in drawn if p[0] <= known] == [p for p in history["points"] if p[0] <= known] == before
            assert int(browser.find_element(By.CSS_SELECTOR, canvas).get_attribute("data-points")) >= len(before)
            # and drawn: the curve has pixels over the steps from the first to the reload's
            latest = drawn[-1][0]
            left, width = 56, 560 - 56 - 10
            assert chart_pixels(browser, canvas, CURVE_BLUE, slice(left, left + int(width * known / latest))) > 20
        finally:
            http.delete(f"/v2/models/demo/jobs/{job}")
        WebDriverWait(browser, 20).until(lambda b: "cancelled" in b.find_element(By.CSS_SELECTOR, f"{card} .state").text)


def test_unavailable_backends_are_folded_with_their_reasons(daemon, browser):
    rows = httpx.get(f"{daemon.url}/v2/devices").json()["rows"]
    unavailable = [(f"{r['backend']}:{r['variant']}", r["reason"]) for r in rows if not r["available"]]
    if not unavailable:
        pytest.skip("every backend is available on this machine: nothing to fold")
    browser.get(f"{daemon.url}/ui")
    WebDriverWait(browser, 20).until(lambda b: "cpu:numpy" in b.find_element(By.ID, "devices").text)
    shown = browser.find_element(By.ID, "devices").text
    assert all(f"{r['backend']}:{r['variant']}" in shown for r in rows if r["available"])
    folded = browser.find_element(By.ID, "unavailable")
    assert folded.tag_name == "details" and folded.get_attribute("open") is None
    assert str(len(unavailable)) in folded.find_element(By.TAG_NAME, "summary").text
    cells = [[td.get_attribute("textContent") for td in tr.find_elements(By.TAG_NAME, "td")]
             for tr in browser.find_elements(By.CSS_SELECTOR, "#unavailable-devices tr")]
    assert [(c[0], c[1]) for c in cells] == unavailable
    assert not any(name in shown for name, _ in unavailable)
    body = browser.find_element(By.CSS_SELECTOR, "#unavailable-devices")
    assert not body.is_displayed()  # folded
    folded.find_element(By.TAG_NAME, "summary").click()
    assert body.is_displayed() and unavailable[0][1] in body.text


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
