"""Where mmad.torch's forward + backward spends its time on a CUDA GPU: the bench's models
(``mmad bench --torch``) at batch 2^18, fp16, ``y = module(x); y.backward(dy)``, profiled with
torch.profiler (CUPTI sees CuPy's kernels too: one process, one context) and cProfile. Printed per
model and per case (parameter gradients only / with input gradients): wall time per step, the GPU's busy
time per step, and the kernels by GPU time, with their launches per step; the host's costliest
calls; the Python functions by their own time. Run by ``scripts/gpu/torch_check.sh profile``.

    python3 scripts/gpu/torch_profile.py [--rows N] [--steps N] [--models image,ngp]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import mmad.torch as mt
from mmad.bench.torch_bench import MODELS, random_params


def kernel_table(prof, steps: int, top: int) -> tuple[float, list[str]]:
    """(the GPU's busy seconds per step, lines of the top kernels)."""
    rows = []
    for ev in prof.key_averages():
        device_us = getattr(ev, "self_device_time_total", None)
        if device_us is None:
            device_us = ev.self_cuda_time_total
        if device_us > 0 and ev.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((device_us, ev.count, ev.key))
    rows.sort(reverse=True)
    busy = sum(r[0] for r in rows) / steps / 1e6
    lines = [f"  {us / steps / 1e3:8.3f} ms/step {count / steps:6.1f} launches/step  {key[:110]}"
             for us, count, key in rows[:top]]
    return busy, lines


def host_table(prof, steps: int, top: int) -> list[str]:
    rows = sorted(((ev.self_cpu_time_total, ev.count, ev.key) for ev in prof.key_averages()), reverse=True)
    return [f"  {us / steps / 1e3:8.3f} ms/step {count / steps:6.1f} calls/step  {key[:110]}" for us, count, key in rows[:top]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1 << 18)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--models", default="image,ngp")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--python-top", type=int, default=30, help="the Python functions by own time under cProfile")
    args = p.parse_args()
    for name in args.models.split(","):
        doc = MODELS[name]
        module = mt.NetworkWithInputEncoding(doc["n_input_dims"], doc["n_output_dims"], doc["encoding"], doc["network"])
        random_params(module, np.random.default_rng(1))
        module.to("cuda")
        x = torch.rand(args.rows, doc["n_input_dims"], device="cuda")
        xg = x.clone().requires_grad_()
        dy = torch.randn(args.rows, doc["n_output_dims"], device="cuda", dtype=torch.float16)
        for case, inp in (("params", x), ("params+input", xg)):
            def step():
                module(inp).backward(dy)

            for _ in range(5):
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.steps
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
            busy, kernels = kernel_table(prof, args.steps, args.top)
            print(f"== {name} {case}: rows {args.rows}, wall {wall * 1e3:.3f} ms/step "
                  f"({args.rows / wall / 1e6:.0f} M samples/s), GPU busy {busy * 1e3:.3f} ms/step "
                  f"({busy / wall:.0%} of the wall time)")
            print("\n".join(kernels))
            print("  host, self time:")
            print("\n".join(host_table(prof, args.steps, 8)))
            python = cProfile.Profile()
            python.enable()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            python.disable()
            text = io.StringIO()
            pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(args.python_top)
            print(f"  Python, {args.steps} steps under cProfile (own time first):")
            print("\n".join("    " + line for line in text.getvalue().splitlines() if line.strip()))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
