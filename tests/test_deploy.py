"""Deployment and release files: the KServe manifests against KServe's CRD schemas (strict, as
``kubectl apply --validate=strict``) and against what mmad serves; LICENSE, CHANGELOG, versions and
constraints.txt against pyproject."""

from __future__ import annotations

import copy
import json
import re
import shlex
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import mmad

ROOT = Path(__file__).resolve().parents[1]
KSERVE = ROOT / "deploy" / "kserve"
SCHEMAS = {"ServingRuntime": "servingruntime.v1alpha1.json", "InferenceService": "inferenceservice.v1beta1.json"}
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def strict(schema: dict) -> dict:
    """The schema with unknown fields refused: Kubernetes prunes them silently unless validation is
    strict, and a misspelt field would then do nothing instead of failing."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def validator(kind: str) -> jsonschema.protocols.Validator:
    schema = json.loads((KSERVE / "schemas" / SCHEMAS[kind]).read_text())
    return jsonschema.Draft7Validator(strict(schema))


def manifests() -> dict[str, dict]:
    docs = {}
    for path in sorted(KSERVE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def test_the_schemas_say_where_they_come_from():
    for kind, name in SCHEMAS.items():
        comment = json.loads((KSERVE / "schemas" / name).read_text())["$comment"]
        assert re.match(r"kserve/kserve v\d+\.\d+\.\d+ \([0-9a-f]{40}\) config/crd/full/", comment), comment
        assert kind in comment and "Apache-2.0" in comment


@pytest.mark.parametrize("kind", SCHEMAS)
def test_manifest_validates_against_the_kserve_crd(kind):
    doc = manifests()[kind]
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(kind).iter_errors(doc)]
    assert not errors, errors
    assert doc["apiVersion"] == {"ServingRuntime": "serving.kserve.io/v1alpha1",
                                 "InferenceService": "serving.kserve.io/v1beta1"}[kind]
    assert DNS_1123_LABEL.fullmatch(doc["metadata"]["name"])


@pytest.mark.parametrize("kind, path, value, message", [
    ("ServingRuntime", ["spec", "containers", 0, "imagee"], "x", "Additional properties"),
    ("ServingRuntime", ["spec", "containers", 0, "ports", 0, "containerPort"], "8000", "is not of type"),
    ("InferenceService", ["spec", "predictor", "model", "modelFormat"], "mmad", "is not of type"),
    ("InferenceService", ["spec", "predictor", "sklearn"], {}, "Additional properties"),
])
def test_the_validation_catches_a_broken_manifest(kind, path, value, message):
    doc = copy.deepcopy(manifests()[kind])
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = list(validator(kind).iter_errors(doc))
    assert errors and any(message in e.message for e in errors), [e.message for e in errors]


def test_runtime_and_service_agree_with_each_other_and_with_the_image():
    docs = manifests()
    runtime, service = docs["ServingRuntime"], docs["InferenceService"]
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"].get("version")) in formats
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"] == ["v2", "grpc-v2"]

    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"  # KServe injects storage and ports into this one
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    port, grpc_port = (int(p) for p in re.findall(r"^EXPOSE (\d+)$", dockerfile, flags=re.M))
    assert [p["containerPort"] for p in container["ports"]] == [port, grpc_port] == [8000, 8001]
    assert container["ports"][1]["name"] == "h2c"  # how KServe tells the gRPC port
    assert f"MMAD_GRPC_PORT={grpc_port}" in dockerfile
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": port}
    uid = int(re.search(r"useradd .*--uid (\d+)", dockerfile).group(1))
    assert container["securityContext"]["runAsUser"] == uid
    # the image tag moves with the release
    assert container["image"].rsplit(":", 1)[1].startswith(mmad.__version__)
    # the key comes from the mounted secret, never a literal value
    env = {e["name"]: e for e in container["env"]}
    assert "MMAD_API_KEY" not in env
    key_dir = env["MMAD_API_KEY_FILE"]["value"].rsplit("/", 1)[0]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == key_dir]
    (volume,) = [v for v in runtime["spec"]["volumes"] if v["name"] == mount["name"]]
    assert "secret" in volume


def test_the_runtime_args_are_what_mmad_serve_takes():
    from mmad.server.main import build_parser

    (container,) = manifests()["ServingRuntime"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--model-repository") + 1] == "/mnt/models"  # where KServe puts storageUri
    parsed = build_parser().parse_args(args)
    assert parsed.model_repository == "/mnt/models", shlex.join(args)


# -- release files -------------------------------------------------------------------------------
def pyproject(path: Path = ROOT / "pyproject.toml") -> dict:
    return tomllib.loads(path.read_text())


def test_license_is_the_apache_2_text_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10_000
    assert pyproject()["project"]["license"] == "Apache-2.0"
    assert pyproject(ROOT / "client" / "pyproject.toml")["project"]["license"] == "Apache-2.0"


def test_one_version_source_per_package_and_both_agree():
    sys.path.insert(0, str(ROOT / "client"))
    import mmad_client

    for path, attr in ((ROOT / "pyproject.toml", "mmad.__version__"),
                       (ROOT / "client" / "pyproject.toml", "mmad_client._base.__version__")):
        doc = pyproject(path)
        assert "version" not in doc["project"] and doc["project"]["dynamic"] == ["version"]
        assert doc["tool"]["setuptools"]["dynamic"]["version"] == {"attr": attr}
    assert re.fullmatch(r"\d+\.\d+\.\d+", mmad.__version__)
    assert mmad_client.__version__ == mmad.__version__


def test_changelog_keeps_a_changelog_and_documents_the_tags():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog") and "keepachangelog.com" in text
    assert re.search(r"^## Unreleased$", text, flags=re.M)
    for section in ("Added", "Changed", "Fixed"):
        assert f"### {section}" in text
    assert "`vMAJOR.MINOR.PATCH`" in text and "git tag -a v" in text
    # released sections, once there are some, carry their date
    for heading in re.findall(r"^## \[?(\d[^\]\s]*)\]?(.*)$", text, flags=re.M):
        assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", heading[1]), heading


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_every_dependency_within_pyproject_bounds():
    pins = constraints()
    requirements = []
    for path, extras in ((ROOT / "pyproject.toml", ("vulkan", "wgpu", "dev")),
                         (ROOT / "client" / "pyproject.toml", ("progress",))):
        doc = pyproject(path)
        optional = doc["project"]["optional-dependencies"]
        requirements += doc["project"]["dependencies"] + [d for e in extras for d in optional[e]]
        requirements += doc["build-system"]["requires"]
    for req in map(Requirement, requirements):
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in constraints.txt (scripts/constraints.py writes it)"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} is outside {req}"


def test_private_api_dependencies_have_an_upper_bound():
    # a module built on another package's non-public classes breaks on that package's next minor
    private = {"uvicorn": r"^from uvicorn\.protocols\."}
    sources = "\n".join(p.read_text() for p in (ROOT / "mmad").rglob("*.py"))
    deps = {canonicalize_name(Requirement(d).name): Requirement(d) for d in pyproject()["project"]["dependencies"]}
    for package, pattern in private.items():
        if re.search(pattern, sources, flags=re.M):
            assert any(s.operator == "<" for s in deps[package].specifier), deps[package]
