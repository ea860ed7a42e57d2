"""The service benchmark's peer: what a user would write to serve an MLP without mmad.

A plain FastAPI app with one synchronous endpoint (FastAPI runs it in its thread pool) that
validates ``{"inputs": [[...], ...]}`` with pydantic, runs the MLP with NumPy in float32 for
that request alone, and returns ``{"outputs": [[...], ...]}``. No batching across requests, no
binary tensors: the straightforward version, served by uvicorn with its default settings.

The weights come from a safetensors file exported from the daemon
(``GET /v2/models/{m}/weights``), so the peer computes the same function as mmad.

    python -m mmad.bench.peer_app --weights M.safetensors --spec M.json --port 8001
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel
from safetensors.numpy import load_file

from mmad.errors import SpecError
from mmad.spec import MLPSpec

ACTIVATIONS = {
    "None": lambda z: z,
    "ReLU": lambda z: np.maximum(z, 0.0, out=z),
}


class InferBody(BaseModel):
    inputs: list[list[float]]


def mlp_forward(spec: MLPSpec, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """h <- act(h @ W^T + b) layer by layer, float32."""
    h = x
    n_layers = len(spec.layer_dims)
    for i in range(n_layers):
        act = spec.output_activation if i == n_layers - 1 else spec.activation
        h = ACTIVATIONS[act](h @ params[f"W{i}"].T + params[f"b{i}"])
    return h


def create_app(spec: MLPSpec, params: dict[str, np.ndarray]) -> FastAPI:
    if not spec.encoding.passthrough:
        raise SpecError("encoding", "the peer implements no encoding (Identity with scale 1 and offset 0 only)")
    for where, act in (("network.activation", spec.activation),
                       ("network.output_activation", spec.output_activation)):
        if act not in ACTIVATIONS:
            raise SpecError(where, f"the peer implements {', '.join(ACTIVATIONS)}; got {act!r}")
    params = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}
    app = FastAPI(title="numpy peer")

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.post("/infer")
    def infer(body: InferBody):
        x = np.asarray(body.inputs, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != spec.n_input_dims:
            return {"error": f"inputs must be [rows, {spec.n_input_dims}]"}
        return {"outputs": mlp_forward(spec, params, x).tolist()}

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmad.bench.peer_app", description=__doc__.splitlines()[0])
    p.add_argument("--weights", required=True, help="safetensors file with W0, b0, ... (fp32)")
    p.add_argument("--spec", required=True, help="the model's tiny-cuda-nn JSON file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    args = p.parse_args(argv)
    import uvicorn

    with open(args.spec, encoding="utf-8") as f:
        spec = MLPSpec.from_json(json.load(f))
    app = create_app(spec, load_file(args.weights))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
