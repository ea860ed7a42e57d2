"""The PyTorch peer of docs/benchmarks.md, defined once for every benchmark script.

``nn.Sequential`` of ``nn.Linear`` + ``ReLU`` with the model's layer widths (or any module, such
as ``mmad.export.to_torch``'s). On a GPU the forward runs in fp16 through a CUDA graph (input
``x.half()``, or the fp32 module under autocast, fp16 output) and the training step is autocast
fp16 + fused Adam on fp32 weights; on the CPU both run in fp32.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from mmad.spec import MLPSpec


def torch_mlp(spec: MLPSpec, device: str) -> Any:
    import torch

    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(spec.layer_dims):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i < len(spec.layer_dims) - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).to(device)


def forward_fn(net: Any, x: Any, autocast: bool = False) -> Callable[[], Any]:
    """One forward as a callable: on a GPU a CUDA-graph replay of the fp16 net on ``x.half()``
    (the graph keeps its own fp16 copy of the weights) or, with ``autocast``, of the fp32 net
    under autocast fp16 on ``x`` as it is (a grid's positions must stay fp32: rounded to fp16
    they fall in other cells); the fp32 net called directly on the CPU."""
    import torch

    if not x.is_cuda:
        def call() -> None:
            with torch.inference_mode():
                net(x)

        return call
    if autocast:
        def run() -> None:
            # no cast cache: a cached cast is freed when the block ends, and the graph would read it
            with torch.autocast(device_type="cuda", dtype=torch.float16, cache_enabled=False):
                net(x)
    else:
        half, xh = copy.deepcopy(net).half(), x.half()

        def run() -> None:
            half(xh)
    with torch.inference_mode():
        run()  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    return graph.replay


def train_step_fn(net: Any, x: Any, y: Any, lr: float = 1e-3) -> Callable[[], None]:
    """One training step as a callable: L2 loss, backward, fused Adam (autocast fp16 on a GPU)."""
    import torch

    net = net.float()
    opt = torch.optim.Adam(net.parameters(), lr=lr, betas=(0.9, 0.99), eps=1e-15, fused=True)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=x.device.type, dtype=torch.float16, enabled=x.is_cuda):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        opt.step()

    return step
