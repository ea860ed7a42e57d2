"""Docker deployment files: compose validates, both files say what docs/service.md promises, and
the cpu image builds, runs healthy and serves the demo model."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_file_validates_with_the_docker_client():
    command = compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (scripts/setup.sh --dev installs it)")
    for profile in ([], ["--profile", "cpu"]):
        proc = subprocess.run([*command, "-f", str(COMPOSE), *profile, "config", "-q"], capture_output=True,
                              text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr


def test_compose_has_store_volume_healthcheck_gpu_reservation_and_cpu_profile():
    doc = yaml.safe_load(COMPOSE.read_text())
    gpu, cpu = doc["services"]["mmad"], doc["services"]["mmad-cpu"]
    for service in (gpu, cpu):
        assert "mmad-store:/data" in service["volumes"]
        assert any("/v2/health/ready" in part for part in service["healthcheck"]["test"])
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in cpu
    assert "mmad-store" in doc["volumes"]


def test_dockerfile_copies_every_package_and_serves_from_the_volume():
    text = DOCKERFILE.read_text()
    copied = set(re.findall(r"^COPY (\S+) ", text, flags=re.M))
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert packages == ["mmad*"] and "mmad" in copied, "the image must copy the one package folder, mmad/"
    for source in copied:
        assert (ROOT / source).exists(), source
    assert 'ENTRYPOINT ["mmad", "serve"]' in text
    assert "MMAD_STORE_DIR=/data/" in text and 'VOLUME ["/data"]' in text
    assert "/v2/health/ready" in text


def test_the_cache_warming_option_writes_the_volume_s_cache_as_the_daemon_s_user():
    """WARM_CACHE runs ``mmad cache warm`` (off by default) after mmad is installed, as the user
    the daemon runs as, into MMAD_CACHE_DIR under /data before the volume is declared (so a new
    volume starts with the cache)."""
    text = DOCKERFILE.read_text()
    warm = text.index('RUN if [ -n "$WARM_CACHE" ]; then mmad cache warm $WARM_CACHE')
    assert re.search(r'^ARG WARM_CACHE=""$', text, flags=re.M)
    assert text.index("RUN pip install --no-cache-dir --no-deps") < text.index("USER mmad") < warm
    assert text.index("MMAD_CACHE_DIR=/data/kernel-cache") < warm < text.index('VOLUME ["/data"]')


def test_dependencies_install_before_the_source_is_copied_at_the_constrained_versions():
    lines = DOCKERFILE.read_text().splitlines()
    copy_source = next(i for i, line in enumerate(lines) if line.startswith("COPY mmad "))
    install_deps = next(i for i, line in enumerate(lines) if "pip install" in line and "-r /tmp/requirements.txt" in line)
    assert install_deps < copy_source, "an edit of mmad/ must not reinstall the dependencies"
    copied_before = " ".join(line for line in lines[:install_deps] if line.startswith("COPY "))
    assert "mmad" not in copied_before.replace("/opt/mmad", "") and "constraints.txt" in copied_before
    assert all("-c constraints.txt" in line for line in lines if "pip install" in line and "--no-deps" not in line)


def test_the_base_image_is_an_exact_tag():
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE.read_text(), flags=re.M).group(1)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base), base


def test_dockerignore_lets_in_exactly_what_the_dockerfile_copies():
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert patterns[0] == "*", "everything out first (a .venv, .git, wheels, bench results), then the files needed"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = set()
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            copied.update(line.split()[1:-1])
    assert allowed == copied


def test_compose_publishes_on_loopback_and_takes_the_key_from_a_secret():
    doc = yaml.safe_load(COMPOSE.read_text())
    for name in ("mmad", "mmad-cpu"):
        service = doc["services"][name]
        for port in service["ports"]:
            # "${ADDR:-127.0.0.1}:${PORT:-8000}:8000": the default address is the loopback one
            address = re.match(r"\$\{MMAD_PUBLISH_ADDR:-([^}]*)\}:", port)
            assert address and address.group(1) == "127.0.0.1", port
        env = service["environment"]
        # the key itself in the environment would show in `docker inspect`
        assert "MMAD_API_KEY" not in env, name
        assert env["MMAD_API_KEY_FILE"] == "/run/secrets/mmad_api_key"
        assert service["secrets"] == ["mmad_api_key"]
    assert "file" in doc["secrets"]["mmad_api_key"]
    assert "/secrets/" in (ROOT / ".gitignore").read_text().splitlines()


def test_docs_pass_the_key_by_file_not_on_the_command_line():
    service_md = (ROOT / "docs" / "service.md").read_text()
    commands = [line for line in service_md.splitlines() if line.lstrip().startswith(("mmad serve", "python -m mmad"))]
    assert commands and not any("--api-key " in line or "--api-key=" in line for line in commands)
    assert "--api-key-file" in service_md and "MMAD_API_KEY_FILE" in service_md


# -- the image, built and run ------------------------------------------------------------------
# The image test builds docker/Dockerfile's cpu variant, runs it, waits for its HEALTHCHECK and
# infers against the demo model. A first build takes a minute or two on 2 cores (the Python
# dependencies are downloaded); a rerun reuses every layer up to the source copy.
IMAGE = "mmad:cpu-test"
PYTHON_IMAGE = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE.read_text(), flags=re.M).group(1)
DEBOOTSTRAP_BASE = "mmad-base:bookworm"


def run(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert not check or proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def docker(tmp_path_factory):
    """The docker command, with an engine that answers: the running one, else a dockerd started
    here (as root) and stopped after the module's tests."""
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client (apt-get install docker.io)")
    info = run(docker, "info", timeout=30)
    if info.returncode == 0:
        yield docker
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0:
        pytest.skip(f"no Docker engine answers ({info.stderr.strip()[-200:]}) and none can be started here "
                    f"({'dockerd is not installed' if dockerd is None else 'not root'})")
    log_path = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([dockerd], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while run(docker, "info", timeout=30).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"dockerd did not start: {log_path.read_text()[-500:]}")
            time.sleep(0.5)
        yield docker
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def base_image(docker: str) -> str:
    """The Dockerfile's Python image if it is here or can be pulled, else one made by debootstrap."""
    if run(docker, "image", "inspect", PYTHON_IMAGE).returncode == 0:
        return PYTHON_IMAGE
    pulled = run(docker, "pull", PYTHON_IMAGE, timeout=600)
    if pulled.returncode == 0:
        return PYTHON_IMAGE
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        pytest.skip(f"{PYTHON_IMAGE} cannot be pulled ({pulled.stderr.strip()[-200:]}) and no base can be made "
                    "with debootstrap here (needs root and `apt-get install debootstrap`)")
    run("bash", "docker/debootstrap-base.sh", DEBOOTSTRAP_BASE, timeout=1200, check=True)
    return DEBOOTSTRAP_BASE


@pytest.fixture(scope="module")
def image(docker, record_testsuite_property):
    base = base_image(docker)
    started = time.monotonic()
    run(docker, "build", "-f", "docker/Dockerfile", "--build-arg", f"PYTHON_IMAGE={base}", "-t", IMAGE, ".",
        timeout=1800, check=True)
    seconds = time.monotonic() - started
    size = int(run(docker, "image", "inspect", "-f", "{{.Size}}", IMAGE, check=True).stdout)
    record_testsuite_property("docker_build_s", round(seconds, 1))
    record_testsuite_property("docker_image_bytes", size)
    print(f"\nbuilt {IMAGE} from {base} in {seconds:.0f} s: {size / 1e6:.0f} MB")
    return IMAGE


def test_the_cpu_image_runs_healthy_serves_the_demo_model_and_stops_cleanly(docker, image):
    sys.path.insert(0, str(ROOT / "client"))
    from mmad_client import Client

    from mmad.backends.cpu import CpuBackend
    from mmad.spec import MLPSpec
    from oracle import rel_err

    name = f"mmad-image-test-{os.getpid()}"
    run(docker, "run", "-d", "--name", name, "-p", "127.0.0.1::8000", image, check=True)
    try:
        deadline = time.monotonic() + 120  # the HEALTHCHECK's first probe is 10 s after the start
        while (health := run(docker, "inspect", "-f", "{{.State.Health.Status}}", name, check=True).stdout.strip()) \
                != "healthy":
            assert health in ("starting", "") and time.monotonic() < deadline, \
                f"health {health!r}:\n{run(docker, 'logs', name).stderr[-3000:]}"
            time.sleep(1)
        host_port = run(docker, "port", name, "8000", check=True).stdout.split()[0]
        with Client(f"http://{host_port}") as client:
            meta = client.model_metadata("demo")
            x = np.random.default_rng(0).uniform(-1, 1, (256, 2)).astype(np.float32)
            y = client.infer("demo", x)
            weights = client.get_weights("demo")
        reference = CpuBackend("float64").compile(MLPSpec.from_json(meta["spec"]))
        reference.set_params(weights)
        assert y.shape == (256, 3)
        # the demo model is fp16: its outputs carry fp16 rounding, the reference none
        assert rel_err(y, reference.forward(x.astype(np.float64))) <= 1e-2
        stopped = run(docker, "stop", "-t", "30", name, timeout=60, check=True)
        assert stopped.returncode == 0
        state = run(docker, "inspect", "-f", "{{.State.ExitCode}}", name, check=True).stdout.strip()
        logs = run(docker, "logs", name)
        assert state == "0" and "Traceback" not in logs.stdout + logs.stderr, logs.stderr[-3000:]
    finally:
        run(docker, "rm", "-f", name)
