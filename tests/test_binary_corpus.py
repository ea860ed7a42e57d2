"""Malformed-request corpus for infer/train, end to end through the app.

Every entry is a request a buggy or hostile client could send (truncated bodies, header lengths
past the body, negative or huge ``binary_data_size``, declared 1 GiB tensors, dtype/shape
mismatches, NaN/Inf, BYTES tensors, duplicate, missing and extra inputs, ...). Each must get
its own 4xx status and a message that names the problem, and the daemon must not allocate
memory sized from a header it has not checked: Python's tracemalloc (which also traces NumPy's
buffers) measures the peak allocated while each request is served, across every thread.
"""

from __future__ import annotations

import gzip
import math
import re
import zlib
import tracemalloc

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient

from mmad.server import Settings, create_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BODY_CAP = 8 * 1024 * 1024
PEAK_LIMIT = 1024 * 1024  # a malformed request is < 1 KiB; measured peaks are < 80 KiB (framework)
GIB = 1 << 30
N_IN, N_OUT = 2, 3  # the demo model


def x_rows(rows: int, cols: int = N_IN, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def tensor(name: str, datatype: str, shape, size=None, data=None) -> dict:
    t = {"name": name, "datatype": datatype, "shape": shape}
    if size is not None:
        t["parameters"] = {"binary_data_size": size}
    if data is not None:
        t["data"] = data
    return t


def binary(inputs: list[dict], blobs: list[bytes], header_length=None, extra=None):
    """(body, headers) of a binary-extension request; ``header_length`` overrides the true one."""
    header = orjson.dumps({"inputs": inputs, **(extra or {})})
    length = len(header) if header_length is None else header_length
    return header + b"".join(blobs), {"Inference-Header-Content-Length": str(length)}


def json_req(inputs, extra=None):
    return orjson.dumps({"inputs": inputs, **(extra or {})}), {"Content-Type": "application/json"}


X4 = x_rows(4)
B4 = X4.tobytes()
NAN = X4.copy()
NAN[1, 1] = np.nan
INF16 = X4.astype(np.float16)
INF16[2, 0] = np.inf
Y4 = x_rows(4, N_OUT, seed=1)

# (id, endpoint, (body, headers), status, message regex)
CORPUS = [
    ("truncated-body", "infer", binary([tensor("INPUT", "FP32", [4, 2], 32)], [B4[:-1]]), 400, "truncated"),
    ("truncated-to-header", "infer", binary([tensor("INPUT", "FP32", [4, 2], 32)], []), 400, "truncated"),
    ("header-length-past-body", "infer",
     (lambda b, h: (b, {"Inference-Header-Content-Length": str(len(b) + 1)}))(
         *binary([tensor("INPUT", "FP32", [4, 2], 32)], [B4])), 400, "past the end of the body"),
    ("header-length-huge", "infer", binary([tensor("INPUT", "FP32", [4, 2], 32)], [B4], header_length=1 << 62),
     400, "past the end of the body"),
    ("header-length-negative", "infer", binary([tensor("INPUT", "FP32", [4, 2], 32)], [B4], header_length=-5),
     400, "must not be negative"),
    ("header-length-not-integer", "infer", binary([tensor("INPUT", "FP32", [4, 2], 32)], [B4], header_length="1e3"),
     400, "must be an integer"),
    ("header-length-cuts-json", "infer",
     (lambda b, h: (b, {"Inference-Header-Content-Length": str(int(h["Inference-Header-Content-Length"]) - 3)}))(
         *binary([tensor("INPUT", "FP32", [4, 2], 32)], [B4])), 400, "not valid JSON"),
    ("binary-size-negative", "infer", binary([tensor("INPUT", "FP32", [4, 2], -32)], [B4]), 400,
     "binary_data_size must be a non-negative integer"),
    ("binary-size-huge", "infer", binary([tensor("INPUT", "FP32", [4, 2], 1 << 62)], [B4]), 400,
     r"binary_data_size is \d+ bytes but shape \[4, 2\] of FP32 needs 32"),
    ("binary-size-float", "infer", binary([tensor("INPUT", "FP32", [4, 2], 32.0)], [B4]), 400,
     "binary_data_size must be a non-negative integer"),
    ("binary-size-bool", "infer", binary([tensor("INPUT", "FP32", [4, 2], True)], [B4]), 400,
     "binary_data_size must be a non-negative integer"),
    ("binary-size-string", "infer", binary([tensor("INPUT", "FP32", [4, 2], "32")], [B4]), 400,
     "binary_data_size must be a non-negative integer"),
    ("declared-1GiB-binary", "infer", binary([tensor("INPUT", "FP32", [GIB // 8, 2], GIB)], [B4]), 400,
     "truncated"),
    ("declared-1GiB-FP16-binary", "infer", binary([tensor("INPUT", "FP16", [GIB // 4, 2], GIB)], [B4]), 400,
     "truncated"),
    ("declared-1GiB-json", "infer", json_req([tensor("INPUT", "FP32", [GIB // 8, 2], data=[0.5, 0.5])]), 400,
     r"holds 2 numbers but shape \[134217728, 2\] needs 268435456"),
    ("declared-2^40-elements", "infer", json_req([tensor("INPUT", "FP32", [1 << 39, 2], data=[0.5, 0.5])]), 400,
     "elements"),
    ("declared-2^40-elements-binary", "infer", binary([tensor("INPUT", "FP32", [1 << 39, 2], 1 << 42)], [B4]),
     400, "elements"),
    ("dtype-size-mismatch", "infer", binary([tensor("INPUT", "FP16", [4, 2], 32)], [B4]), 400,
     r"binary_data_size is 32 bytes but shape \[4, 2\] of FP16 needs 16"),
    ("dtype-unsupported-FP64", "infer", binary([tensor("INPUT", "FP64", [4, 2], 64)], [B4 + B4]), 400,
     "datatype must be one of FP32, FP16; got 'FP64'"),
    ("dtype-unsupported-INT8", "infer", json_req([tensor("INPUT", "INT8", [1, 2], data=[1, 2])]), 400,
     "datatype must be one of FP32, FP16; got 'INT8'"),
    ("dtype-missing", "infer", json_req([{"name": "INPUT", "shape": [1, 2], "data": [1, 2]}]), 400,
     "datatype must be one of FP32, FP16; got None"),
    ("bytes-json", "infer", json_req([tensor("BYTES_IN", "BYTES", [1], data=["abc"])]), 400,
     "datatype must be one of FP32, FP16; got 'BYTES'"),
    ("bytes-binary", "infer", binary([tensor("INPUT", "BYTES", [1], 7)], [b"\x03\0\0\0abc"]), 400,
     "datatype must be one of FP32, FP16; got 'BYTES'"),
    ("shape-wrong-cols", "infer", binary([tensor("INPUT", "FP32", [2, 4], 32)], [B4]), 400,
     r"input 'INPUT' must have shape \[rows >= 1, 2\]; got \[2, 4\]"),
    ("shape-1d", "infer", binary([tensor("INPUT", "FP32", [8], 32)], [B4]), 400,
     r"must have shape \[rows >= 1, 2\]; got \[8\]"),
    ("shape-3d", "infer", binary([tensor("INPUT", "FP32", [2, 2, 2], 32)], [B4]), 400,
     r"must have shape \[rows >= 1, 2\]; got \[2, 2, 2\]"),
    ("shape-zero-rows", "infer", binary([tensor("INPUT", "FP32", [0, 2], 0)], []), 400,
     r"must have shape \[rows >= 1, 2\]; got \[0, 2\]"),
    ("shape-negative", "infer", binary([tensor("INPUT", "FP32", [-4, 2], 32)], [B4]), 400,
     "shape must be a non-empty list of non-negative integers"),
    ("shape-empty", "infer", json_req([tensor("INPUT", "FP32", [], data=[1.0])]), 400,
     "shape must be a non-empty list of non-negative integers"),
    ("shape-not-list", "infer", json_req([tensor("INPUT", "FP32", "4x2", data=[1.0])]), 400,
     "shape must be a non-empty list of non-negative integers"),
    ("shape-floats", "infer", json_req([tensor("INPUT", "FP32", [1.0, 2.0], data=[1.0, 2.0])]), 400,
     "shape must be a non-empty list of non-negative integers"),
    ("nan-binary-fp32", "infer", binary([tensor("INPUT", "FP32", [4, 2], 32)], [NAN.tobytes()]), 400,
     "input 'INPUT' holds NaN or Inf"),
    ("inf-binary-fp16", "infer", binary([tensor("INPUT", "FP16", [4, 2], 16)], [INF16.tobytes()]), 400,
     "input 'INPUT' holds NaN or Inf"),
    ("overflow-json-fp32", "infer", json_req([tensor("INPUT", "FP32", [1, 2], data=[1e308, 0.0])]), 400,
     "input 'INPUT' holds NaN or Inf"),
    ("nan-literal-json", "infer", (b'{"inputs":[{"name":"INPUT","datatype":"FP32","shape":[1,2],"data":[NaN,1]}]}',
                                   {}), 400, "not valid JSON"),
    ("nan-target-train", "train", binary([tensor("INPUT", "FP32", [4, 2], 32), tensor("TARGET", "FP32", [4, 3], 48)],
                                         [B4, np.full((4, 3), np.nan, np.float32).tobytes()]), 400,
     "input 'TARGET' holds NaN or Inf"),
    ("duplicate-input", "infer", binary([tensor("INPUT", "FP32", [4, 2], 32), tensor("INPUT", "FP32", [4, 2], 32)],
                                        [B4, B4]), 400, "input 'INPUT' is given twice"),
    ("duplicate-input-json", "infer", json_req([tensor("INPUT", "FP32", [1, 2], data=[1, 2]),
                                                tensor("INPUT", "FP32", [1, 2], data=[1, 2])]), 400,
     "input 'INPUT' is given twice"),
    ("missing-all-inputs", "infer", json_req([]), 400, "inputs must be a non-empty list"),
    ("missing-inputs-key", "infer", (orjson.dumps({"outputs": []}), {}), 400, "inputs must be a non-empty list"),
    ("missing-input", "infer", json_req([tensor("OTHER", "FP32", [1, 2], data=[1, 2])]), 400,
     "unknown input 'OTHER'"),
    ("missing-target-train", "train", binary([tensor("INPUT", "FP32", [4, 2], 32)], [B4]), 400,
     "input 'TARGET' is missing"),
    ("extra-input", "infer", binary([tensor("INPUT", "FP32", [4, 2], 32), tensor("EXTRA", "FP32", [4, 2], 32)],
                                    [B4, B4]), 400, "unknown input 'EXTRA'"),
    ("extra-input-train", "train", binary([tensor("INPUT", "FP32", [4, 2], 32), tensor("TARGET", "FP32", [4, 3], 48),
                                           tensor("WEIGHT", "FP32", [4, 2], 32)], [B4, Y4.tobytes(), B4]), 400,
     "unknown input 'WEIGHT'"),
    ("rows-mismatch-train", "train", binary([tensor("INPUT", "FP32", [4, 2], 32), tensor("TARGET", "FP32", [3, 3], 36)],
                                            [B4, Y4[:3].tobytes()]), 400, "input 'TARGET' has 3 rows; INPUT has 4"),
    ("trailing-bytes", "infer", binary([tensor("INPUT", "FP32", [4, 2], 32)], [B4 + b"\0" * 5]), 400,
     "5 bytes after the last binary tensor"),
    ("binary-size-without-header", "infer", json_req([tensor("INPUT", "FP32", [4, 2], 32)]), 400,
     "has binary_data_size but the request has no Inference-Header-Content-Length"),
    ("data-and-binary", "infer", binary([tensor("INPUT", "FP32", [4, 2], 32, data=[0.0] * 8)], [B4]), 400,
     "has both data and binary_data_size"),
    ("neither-data-nor-binary", "infer", json_req([tensor("INPUT", "FP32", [4, 2])]), 400,
     "has neither data nor parameters.binary_data_size"),
    ("fp16-as-json", "infer", json_req([tensor("INPUT", "FP16", [1, 2], data=[1.0, 2.0])]), 400,
     "FP16 is only accepted as binary data"),
    ("json-data-strings", "infer", json_req([tensor("INPUT", "FP32", [1, 2], data=["a", "b"])]), 400,
     "data must hold only numbers"),
    ("json-data-null", "infer", json_req([tensor("INPUT", "FP32", [1, 2], data=[None, 1.0])]), 400,
     "data must hold only numbers; got null"),
    ("json-data-text", "infer", json_req([tensor("INPUT", "FP32", [2, 1], data=[["x"], ["y"]])]), 400,
     'data must hold only numbers; got the text "x"'),
    ("json-data-booleans", "infer", json_req([tensor("INPUT", "FP32", [1, 2], data=[True, False])]), 400,
     "data must hold only numbers; got true"),
    ("json-data-objects", "infer", json_req([tensor("INPUT", "FP32", [1, 2], data=[{"a": 1}, 2])]), 400,
     "data must hold only numbers; got an object"),
    ("json-data-ragged", "infer", json_req([tensor("INPUT", "FP32", [2, 2], data=[[1.0, 2.0], [3.0]])]), 400,
     "data must be numbers.*rows have different lengths"),
    ("json-data-mixed-nesting", "infer", json_req([tensor("INPUT", "FP32", [2, 2], data=[[1.0, 2.0], 3.0])]), 400,
     "rows have different lengths"),
    ("json-data-count", "infer", json_req([tensor("INPUT", "FP32", [2, 2], data=[1.0, 2.0, 3.0])]), 400,
     r"holds 3 numbers but shape \[2, 2\] needs 4"),
    ("json-data-nesting", "infer", json_req([tensor("INPUT", "FP32", [2, 2], data=[[1.0], [2.0], [3.0], [4.0]])]), 400,
     r"nested as \[4, 1\] but shape is \[2, 2\]"),
    ("header-not-json", "infer", (b"\x00\x01garbage", {"Inference-Header-Content-Length": "9"}), 400,
     r"the request's JSON part \(its first 9 bytes, per Inference-Header-Content-Length\) is not valid JSON"),
    ("body-not-json", "infer", (b"{inputs: []}", {"Content-Type": "application/json"}), 400,
     "^the request body is not valid JSON"),
    ("body-empty", "infer", (b"", {}), 400, "the request body is empty"),
    ("header-is-array", "infer", (b"[1,2]", {}), 400, "the request must be a JSON object"),
    ("input-not-object", "infer", json_req([[1, 2]]), 400, r"inputs\[0\] must be a JSON object"),
    ("input-name-missing", "infer", json_req([{"datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]), 400,
     r"inputs\[0\].name must be a non-empty string"),
    ("parameters-not-object", "infer", json_req([tensor("INPUT", "FP32", [1, 2], data=[1, 2])], {"parameters": [1]}),
     400, "parameters must be a JSON object"),
    ("output-fp16-as-json", "infer", json_req([tensor("INPUT", "FP32", [1, 2], data=[1, 2])],
                                              {"outputs": [{"name": "OUTPUT", "parameters": {"output_datatype": "FP16"}}]}),
     400, "FP16 is only returned as binary data"),
    ("output-unknown", "infer", json_req([tensor("INPUT", "FP32", [1, 2], data=[1, 2])], {"outputs": [{"name": "X"}]}),
     400, "unknown output 'X'"),
    ("train-steps-negative", "train", binary([tensor("INPUT", "FP32", [4, 2], 32), tensor("TARGET", "FP32", [4, 3], 48)],
                                             [B4, Y4.tobytes()], extra={"parameters": {"steps": -1}}), 400,
     "parameters.steps must be an integer"),
    ("body-over-cap", "infer", (b"{" + b" " * BODY_CAP + b"}", {}), 413, "limit"),
    ("gzip-bomb", "infer", (gzip.compress(b" " * (4 * BODY_CAP)), {"Content-Encoding": "gzip"}), 413,
     "decompressed body exceeds the limit"),
    ("gzip-corrupt", "infer", (b"\x1f\x8b\x08\x00garbage" * 4, {"Content-Encoding": "gzip"}), 400,
     "cannot be decompressed"),
    ("gzip-truncated", "infer", (gzip.compress(orjson.dumps({"inputs": [tensor("INPUT", "FP32", [1, 2], data=[1, 2])]}))[:-12],
                                 {"Content-Encoding": "gzip"}), 400, "truncated"),
    ("deflate-then-bad-json", "infer", (zlib.compress(b"{not json"), {"Content-Encoding": "deflate"}), 400,
     "not valid JSON"),
    ("encoding-unsupported", "infer", (b"{}", {"Content-Encoding": "br"}), 400, "Content-Encoding 'br' is not supported"),
]
# decompression may hold up to the body cap (plus one 1 MiB inflate step) before it refuses,
# never an amount a header asks for
DECOMPRESSING = {"gzip-bomb", "gzip-corrupt", "gzip-truncated", "deflate-then-bad-json"}


# what NumPy or the JSON parser would say, never the user: dtype codes, NumPy's shape errors,
# the "header" of a plain JSON request, Python type names
NUMPY_WORDS = re.compile(r"<[UfiSb]\d|\bdtype\b|inhomogeneous|array element|\bndarray\b|\(document\)|"
                         r"\bNoneType\b|\bstr\b|\bdict\b|\bbool_?\b|float64|object_|zero-length")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    store = tmp_path_factory.mktemp("corpus") / "store"
    app = create_app(Settings(store_dir=store, backend="cpu", probe="cpu", max_body_bytes=BODY_CAP))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def served_peak(client: TestClient, endpoint: str, body: bytes, headers: dict) -> tuple[object, int]:
    """The response and the peak bytes allocated (all threads) while it was served."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        base, _ = tracemalloc.get_traced_memory()
        r = client.post(f"/v2/models/demo/{endpoint}", content=body, headers=headers)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return r, peak - base


def test_corpus_ids_are_unique():
    ids = [c[0] for c in CORPUS]
    assert len(ids) == len(set(ids))
    assert len(CORPUS) >= 50


@pytest.mark.parametrize("case", CORPUS, ids=[c[0] for c in CORPUS])
def test_malformed_request_gets_its_own_4xx(client, case):
    name, endpoint, (body, headers), status, message = case
    r, peak = served_peak(client, endpoint, body, headers)
    assert r.status_code == status, f"{name}: {r.status_code} {r.text}"
    error = r.json()["error"]
    assert re.search(message, error), f"{name}: message {error!r} does not match {message!r}"
    assert not NUMPY_WORDS.search(error), f"{name}: {error!r} speaks NumPy, not the request's terms"
    limit = PEAK_LIMIT + (2 * len(body) if status != 413 else 0) + (BODY_CAP + (2 << 20) if name in DECOMPRESSING else 0)
    assert peak < limit, f"{name}: {peak / 2**20:.1f} MiB allocated while refusing a {len(body)} byte request"


def test_memory_measurement_sees_real_tensors(client):
    """Calibration: a valid 4 MiB binary request does show up, so the bound above is meaningful."""
    rows = 512 * 1024
    x = x_rows(rows)
    body, headers = binary([tensor("INPUT", "FP32", [rows, 2], x.nbytes)], [x.tobytes()],
                           extra={"outputs": [{"name": "OUTPUT", "parameters": {"binary_data": True}}]})
    r, peak = served_peak(client, "infer", body, headers)
    assert r.status_code == 200, r.text
    assert peak > x.nbytes, f"only {peak} bytes traced for a {x.nbytes} byte tensor"


def test_daemon_still_serves_after_the_corpus(client):
    x = x_rows(3)
    r = client.post("/v2/models/demo/infer", json={"inputs": [tensor("INPUT", "FP32", [3, 2], data=x.tolist())]})
    assert r.status_code == 200, r.text
    out = np.asarray(r.json()["outputs"][0]["data"], np.float32)
    assert out.shape == (3 * N_OUT,) and np.isfinite(out).all() and math.isfinite(float(np.abs(out).sum()))
