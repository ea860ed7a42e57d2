"""Docker deployment files: compose validates, and both files say what docs/service.md promises."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

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
