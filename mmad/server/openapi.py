"""OpenAPI descriptions of the bodies routes read themselves (raw ``Request``), so that clients
and fuzzers see what is accepted: OIP v2 inference requests as JSON or the binary tensor
extension, and raw safetensors bodies."""

from __future__ import annotations

from typing import Any

_OIP_TENSOR = {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
    "name": {"type": "string"}, "datatype": {"type": "string", "enum": ["FP32", "FP16"]},
    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "data": {"type": "array", "items": {"type": "number"}},
    "parameters": {"type": "object", "properties": {"binary_data_size": {"type": "integer", "minimum": 0}}}}}
_OIP_REQUEST = {"type": "object", "required": ["inputs"], "properties": {
    "id": {"type": "string"}, "parameters": {"type": "object"},
    "inputs": {"type": "array", "minItems": 1, "items": _OIP_TENSOR},
    "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "parameters": {"type": "object"}}}}}}
_BINARY = {"schema": {"type": "string", "format": "binary"}}
TENSOR_REQUEST_DOC: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": _OIP_REQUEST},
                                                  "application/octet-stream": _BINARY}},
    "parameters": [{"name": "Inference-Header-Content-Length", "in": "header", "required": False,
                    "description": "binary tensor extension: bytes of JSON header before the tensors",
                    "schema": {"type": "integer"}}],
}
BINARY_REQUEST_DOC: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/octet-stream": _BINARY}}}
TENSOR_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "JSON, or the binary tensor extension (Inference-Header-Content-Length)",
          "content": {"application/json": {}, "application/octet-stream": _BINARY}}}
