"""Unit tests of the wire format (server/binary.py): every length is checked against the body."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from mmad.errors import InvalidInput
from mmad.server.binary import (
    encode_infer_response, parse_header_length, parse_infer_request, requested_outputs,
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
