"""Unit tests of the wire format (server/binary.py): every length is checked against the body."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from mmad.errors import InvalidInput
from mmad.server.binary import (
    DATA_ALIGN, OutputChoice, binary_response_buffer, encode_infer_response, parse_header_length,
    parse_infer_request, requested_outputs,
)


def binary_body(arrays: dict[str, np.ndarray], datatype: str = "FP32", extra: dict | None = None):
    inputs, blobs = [], []
    for name, a in arrays.items():
        blob = a.tobytes()
        inputs.append({"name": name, "datatype": datatype, "shape": list(a.shape),
                       "parameters": {"binary_data_size": len(blob)}})
        blobs.append(blob)
    header = orjson.dumps({"inputs": inputs, **(extra or {})})
    return header + b"".join(blobs), len(header)


def test_binary_fp32_and_fp16_roundtrip_exactly():
    rng = np.random.default_rng(1)
    x32 = rng.standard_normal((7, 3)).astype(np.float32)
    body, n = binary_body({"INPUT": x32})
    req = parse_infer_request(body, n)
    assert req.binary_inputs and np.array_equal(req.tensors["INPUT"], x32)
    x16 = x32.astype(np.float16)
    body, n = binary_body({"INPUT": x16}, "FP16")
    assert np.array_equal(parse_infer_request(body, n).tensors["INPUT"], x16)


def test_json_nested_and_flat_data_agree():
    x = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    for data in (x.tolist(), x.reshape(-1).tolist()):
        doc = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [2, 3], "data": data}]}
        assert np.array_equal(parse_infer_request(orjson.dumps(doc), None).tensors["INPUT"], x)


@pytest.mark.parametrize("mutate, message", [
    (lambda b, n: (b[:-1], n), "truncated"),
    (lambda b, n: (b + b"\0", n), "after the last binary tensor"),
    (lambda b, n: (b, n - 1), "not valid JSON"),
])
def test_inconsistent_binary_bodies_are_refused(mutate, message):
    body, n = binary_body({"INPUT": np.ones((4, 2), np.float32)})
    body, n = mutate(body, n)
    with pytest.raises(InvalidInput, match=message):
        parse_infer_request(body, n)


def test_header_length_past_the_body_is_refused():
    with pytest.raises(InvalidInput, match="past the end of the body"):
        parse_header_length("100", 99)
    with pytest.raises(InvalidInput, match="integer"):
        parse_header_length("ten", 99)


def test_binary_size_must_match_shape_and_dtype():
    body, n = binary_body({"INPUT": np.ones((4, 2), np.float32)})
    header = orjson.loads(body[:n])
    header["inputs"][0]["shape"] = [4, 3]
    new_header = orjson.dumps(header)
    with pytest.raises(InvalidInput, match="binary_data_size is 32 bytes but shape"):
        parse_infer_request(new_header + body[n:], len(new_header))


@pytest.mark.parametrize("tensor, message", [
    ({"name": "INPUT", "datatype": "FP16", "shape": [1, 2], "data": [1, 2]}, "only accepted as binary"),
    ({"name": "INPUT", "datatype": "INT32", "shape": [1, 2], "data": [1, 2]}, "datatype must be one of"),
    ({"name": "INPUT", "datatype": "FP32", "shape": [1, 3], "data": [1, 2]}, "needs 3"),
    ({"name": "INPUT", "datatype": "FP32", "shape": [1, 2], "data": ["1", "2"]}, "only numbers"),
    ({"name": "INPUT", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3]]}, "must be numbers"),
    ({"name": "INPUT", "datatype": "FP32", "shape": [-1, 2], "data": [1, 2]}, "shape must be"),
    ({"name": "INPUT", "datatype": "FP32", "shape": [1, 2]}, "neither data nor"),
])
def test_malformed_json_tensors_are_refused(tensor, message):
    with pytest.raises(InvalidInput, match=message):
        parse_infer_request(orjson.dumps({"inputs": [tensor]}), None)


def test_requested_outputs_and_response_encoding():
    doc = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 1], "data": [1]}],
           "outputs": [{"name": "OUTPUT", "parameters": {"binary_data": True, "output_datatype": "FP16"}}]}
    req = parse_infer_request(orjson.dumps(doc), None)
    (choice,) = requested_outputs(req, ("OUTPUT",))
    assert choice.binary and choice.datatype == "FP16"
    out = np.array([[0.5, -2.0]], dtype=np.float32)
    body, n = encode_infer_response({"model_name": "m"}, [(choice, out)])
    header = orjson.loads(body[:n])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 4
    assert np.array_equal(np.frombuffer(body[n:], "<f2").reshape(1, 2), out.astype(np.float16))
    doc["outputs"] = [{"name": "OUTPUT", "parameters": {"output_datatype": "FP16"}}]
    with pytest.raises(InvalidInput, match="only returned as binary"):
        requested_outputs(parse_infer_request(orjson.dumps(doc), None), ("OUTPUT",))
    doc["outputs"] = [{"name": "NOPE"}]
    with pytest.raises(InvalidInput, match="unknown output"):
        requested_outputs(parse_infer_request(orjson.dumps(doc), None), ("OUTPUT",))


def test_binary_response_buffer_is_aligned_and_decodes():
    body, n, tensor = binary_response_buffer({"model_name": "m", "id": "x"}, OutputChoice("OUTPUT", True, "FP16"),
                                             (3, 5))
    assert n % DATA_ALIGN == 0 and len(body) == n + 3 * 5 * 2
    assert tensor.flags.aligned and tensor.flags.writeable and tensor.dtype == np.float16
    tensor[...] = np.arange(15).reshape(3, 5)
    header = orjson.loads(body[:n])  # the padding is JSON whitespace
    assert header["outputs"] == [{"name": "OUTPUT", "datatype": "FP16", "shape": [3, 5],
                                  "parameters": {"binary_data_size": 30}}]
    assert np.array_equal(np.frombuffer(body[n:], "<f2").reshape(3, 5), np.arange(15).reshape(3, 5))
    with pytest.raises(ValueError, match="not binary"):
        binary_response_buffer({}, OutputChoice("OUTPUT", False, "FP32"), (1, 1))


def _placed(run, remote: bool):
    """The batcher's (run, remote) for ``run`` on the compute threads, or awaited as another
    process's forward (a serving worker's small batches), where ``run`` itself must not be called."""
    if not remote:
        return run, None

    async def forward(x, out, check_finite):
        await asyncio.sleep(0)  # (an answer that comes later, as over the worker's socket)
        run(x, out, check_finite)

    def unused(x, out, check_finite):
        raise AssertionError("a batch the remote forward takes ran on the compute threads")

    return unused, lambda x: forward


@pytest.mark.parametrize("remote", [False, True], ids=["compute threads", "another process"])
def test_batcher_fails_only_the_requests_that_bring_nan(remote):
    """A merged batch whose check finds NaN/Inf: the requests that brought it fail with
    NonFiniteInput, the others (checked or not) get their rows from a second, unchecked run;
    the same where another process runs the batches."""
    from concurrent.futures import ThreadPoolExecutor

    from mmad.errors import NonFiniteInput
    from mmad.engine.batcher import Batcher, BatchLimits

    calls = []

    def run(x, out, check_finite):
        calls.append((x.shape[0], check_finite))
        if check_finite and not np.isfinite(x).all():
            raise NonFiniteInput("the input rows hold NaN or Inf")
        out[...] = 2 * x[:, :1]

    clean, bad, unchecked = (np.full((3, 2), 1, np.float32), np.full((2, 2), np.nan, np.float32),
                             np.full((4, 2), np.inf, np.float32))
    local, elsewhere = _placed(run, remote)

    async def main():
        with ThreadPoolExecutor(1) as pool:
            batcher = Batcher("m", local, 1, pool, BatchLimits(1024, 50_000, 16), remote=elsewhere)
            results = await asyncio.gather(batcher.submit(clean, None, True), batcher.submit(bad, None, True),
                                           batcher.submit(unchecked), return_exceptions=True)
            alone = await asyncio.gather(batcher.submit(bad, None, True), return_exceptions=True)
            await batcher.stop()
        return results, alone[0]

    (first, second, third), alone = asyncio.run(main())
    assert calls == [(9, True), (9, False), (2, True)]
    assert np.array_equal(first.output, np.full((3, 1), 2, np.float32)) and first.batch_requests == 3
    assert isinstance(second, NonFiniteInput) and isinstance(alone, NonFiniteInput)
    assert np.array_equal(third.output, np.full((4, 1), np.inf, np.float32))  # allowed: not checked


@pytest.mark.parametrize("remote", [False, True], ids=["compute threads", "another process"])
def test_batcher_fills_given_buffers_alone_and_merged(remote):
    """A request alone is computed straight into its buffer; merged, its rows are copied there;
    the same where another process runs the batches."""
    from concurrent.futures import ThreadPoolExecutor

    from mmad.engine.batcher import Batcher, BatchLimits

    calls = []

    def run(x, out, check_finite):
        calls.append((x.shape[0], out.dtype))
        out[...] = 2 * x[:, :1].astype(np.float32)

    local, elsewhere = _placed(run, remote)

    async def main():
        with ThreadPoolExecutor(1) as pool:
            batcher = Batcher("m", local, 1, pool, BatchLimits(1024, 50_000, 16), remote=elsewhere)
            alone = np.empty((3, 1), np.float16)
            result = await batcher.submit(np.ones((3, 2), np.float16), alone)
            assert result.output is alone and np.array_equal(alone, np.full((3, 1), 2, np.float16))
            buffer = np.empty((2, 1), np.float16)
            merged = await asyncio.gather(batcher.submit(np.full((2, 2), 3, np.float16), buffer),
                                          batcher.submit(np.full((4, 2), 5, np.float32)))
            await batcher.stop()
        return merged

    first, second = asyncio.run(main())
    assert calls == [(3, np.float16), (6, np.float32)]
    assert first.output is not None and np.array_equal(first.output, np.full((2, 1), 6, np.float16))
    assert first.batch_requests == 2 and np.array_equal(second.output, np.full((4, 1), 10, np.float32))


@pytest.mark.parametrize("in_type,out_type", [("FP16", "FP16"), ("FP32", "FP16"), ("FP16", "FP32")])
def test_large_chunked_request_equals_unchunked_forward(http, in_type, out_type):
    """Through the daemon: a request of several chunks (rows not a multiple of the chunk, tensor
    data at an unaligned offset of the request) runs chunked on the forward threads and is cast
    per chunk into the response. Compared with the unchunked ``forward`` of the same weights:
    float32 within float32 rounding (1e-6), FP16 within one FP16 ulp plus that (the casts
    themselves are bit-exact, tests/test_cpu_backend.py; BLAS may round the last float32 bits
    differently by chunk shape, which can move a value across an FP16 rounding boundary)."""
    from safetensors.numpy import load as st_load

    from mmad.backends.cpu import HOST_CHUNK_ROWS, CpuBackend
    from mmad.spec import MLPSpec

    rows = 3 * HOST_CHUNK_ROWS + 123
    spec = MLPSpec.from_json(http.get("/v2/models/demo").json()["spec"])
    x = np.random.default_rng(rows).uniform(-1, 1, (rows, spec.n_input_dims))
    x = x.astype(np.float16 if in_type == "FP16" else np.float32)
    blob = x.astype("<f2" if in_type == "FP16" else "<f4").tobytes()
    header = orjson.dumps({"inputs": [{"name": "INPUT", "datatype": in_type, "shape": list(x.shape),
                                       "parameters": {"binary_data_size": len(blob)}}],
                           "outputs": [{"name": "OUTPUT", "parameters": {"binary_data": True,
                                                                         "output_datatype": out_type}}],
                           "id": "odd"})
    assert len(header) % 4  # the tensor data starts unaligned in the request body
    r = http.post("/v2/models/demo/infer", content=header + blob,
                  headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    out = np.frombuffer(r.content[n:], "<f2" if out_type == "FP16" else "<f4").reshape(rows, spec.n_output_dims)
    with CpuBackend().compile(spec) as ref:
        ref.set_params(st_load(http.get("/v2/models/demo/weights").content))
        expected = ref.forward(x.astype(np.float32))
    if out_type == "FP32":
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    else:
        ulp = np.spacing(np.abs(expected.astype(np.float16))).astype(np.float32)
        assert np.all(np.abs(out.astype(np.float32) - expected) <= ulp + 1e-6)
