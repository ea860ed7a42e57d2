"""Schema fuzzing: schemathesis against the daemon's own OpenAPI document.

A real daemon subprocess (cpu backend, 127.0.0.1, demo model) serves ``/openapi.json``;
schemathesis generates requests for every operation in it: path parameters, query strings and
the JSON / binary bodies the schema declares, in three passes per operation (random positive
data, positive data aimed at the existing model ``demo`` version 1, and, where the operation
has a body or query parameters, schema-violating "negative" data). Every response must pass:

- ``not_a_server_error``: no 5xx;
- ``status_code_conformance``: the status is documented for the operation;
- ``content_type_conformance`` and ``response_headers_conformance``;
- ``response_schema_conformance``: the body matches the documented schema.

``positive_data_acceptance`` is left out on purpose: a generated spec that satisfies the
document's ``{"type": "object"}`` is still not a valid model, and 400 is the right answer.
After every operation the daemon must still be alive (zero crashes), and the demo model is put
back if the fuzzer deleted or unloaded it. At least 2,000 requests, bounded in time.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install schemathesis)")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi import checks as openapi_checks  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MIN_REQUESTS = 2000
TIME_BUDGET_S = 150.0
EXAMPLES_PER_PASS = 60
CHECKS = [not_a_server_error, openapi_checks.status_code_conformance, openapi_checks.content_type_conformance,
          openapi_checks.response_headers_conformance, openapi_checks.response_schema_conformance]
DEMO_SPEC_URL = "/v2/models/demo"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    fault_injection = load_script("fault_injection")
    proc = fault_injection.Daemon(tmp_path_factory.mktemp("fuzz") / "store", "--max-body-bytes", str(1 << 20),
                                  demo=True).start()
    yield proc
    proc.kill()


def restore_demo(http: httpx.Client, spec: dict) -> None:
    """Put the demo model back (the fuzzer may delete, replace or unload it)."""
    meta = http.get(DEMO_SPEC_URL)
    if meta.status_code == 404 or (meta.status_code == 200 and meta.json().get("spec") != spec):
        assert http.put(DEMO_SPEC_URL, json={"spec": spec}).status_code in (200, 201)
    elif meta.status_code == 200 and meta.json().get("state") != "READY":
        assert http.post("/v2/repository/models/demo/load").status_code == 200


@pytest.mark.timeout(TIME_BUDGET_S + 60)
def test_schema_fuzzing(daemon):
    schema = schemathesis.openapi.from_url(f"{daemon.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25, "the OpenAPI document lists too few operations"
    http = httpx.Client(base_url=daemon.url, timeout=30.0)
    demo_spec = http.get(DEMO_SPEC_URL).json()["spec"]
    import requests

    session = requests.Session()
    sent = Counter()
    statuses = Counter()
    failures: dict[tuple[str, str], str] = {}
    crashes = []
    started = time.monotonic()

    def passes(op):
        fixed = {k: v for k, v in (("model", "demo"), ("version", "1")) if f"{{{k}}}" in op.path}
        yield "random", op.as_strategy(GenerationMode.POSITIVE)
        if fixed:
            yield "demo", op.as_strategy(GenerationMode.POSITIVE, path_parameters=fixed)
        if len(op.body) or len(op.query):  # a free-form path string has no invalid value to generate
            yield "negative", op.as_strategy(GenerationMode.NEGATIVE)

    for op in operations:
        for label, strategy in passes(op):
            if time.monotonic() - started > TIME_BUDGET_S:
                break

            @given(case=strategy)
            @settings(max_examples=EXAMPLES_PER_PASS, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            def fuzz(case):
                sent[op.label] += 1
                try:
                    response = case.call(base_url=daemon.url, session=session, timeout=30)
                except requests.RequestException as exc:
                    crashes.append(f"{op.label}: {type(exc).__name__}: {exc}")
                    return
                statuses[response.status_code] += 1
                try:
                    case.validate_response(response, checks=CHECKS)
                except (Exception, BaseExceptionGroup) as exc:  # noqa: B036 - schemathesis raises groups
                    first_line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip().startswith("-")),
                                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                    failures.setdefault((op.label, first_line), str(exc)[:1500])

            try:
                fuzz()
            except Exception as exc:  # noqa: BLE001 - e.g. no negative data can be generated for this operation
                if "Unsatisfiable" not in type(exc).__name__ and "unsatisfiable" not in str(exc).lower():
                    raise
            if not daemon.alive:
                crashes.append(f"the daemon died while fuzzing {op.label} ({label}):\n{daemon.log_tail()}")
                break
            restore_demo(http, demo_spec)
        if crashes and not daemon.alive:
            break
    elapsed = time.monotonic() - started
    total = sum(sent.values())
    print(f"\nschemathesis: {total} requests over {len(operations)} operations in {elapsed:.1f} s; "
          f"statuses {dict(sorted(statuses.items()))}; {len(failures)} distinct failures")
    by_op = defaultdict(list)
    for (label, title), detail in failures.items():
        by_op[label].append(title)
    assert not crashes, "\n".join(crashes[:10])
    assert not failures, "\n\n".join(f"{label}: {detail}" for (label, _), detail in list(failures.items())[:8]) + \
        "\n\nall: " + repr(dict(by_op))
    assert not any(s >= 500 for s in statuses), statuses
    assert total >= MIN_REQUESTS, f"only {total} requests were generated in {elapsed:.0f} s"
    assert daemon.alive
