#!/usr/bin/env python3
"""Draw docs/benchmarks.png: mmad's kernel throughput against PyTorch and tiny-cuda-nn, S/M/L/W.

The figures come from the committed benchmark JSON, nothing is typed in here:

- mmad and the same-run PyTorch peer: ``mmad bench --backend cuda ... --json`` output
  (``dispatch-h100-bench.json``: each row's ``samples_per_s`` and ``peer_seconds``);
- tiny-cuda-nn: ``tcnn-h100-reference.json`` (its native C++ API on the same GPU kind, batch and I/O).

Usage: ``python scripts/plot_benchmarks.py [--results-dir bench/results] [--out docs/benchmarks.png]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("S", "M", "L", "W")
MODES = ("forward", "train")
KERNELS_FILE = "dispatch-h100-bench.json"
TCNN_FILE = "tcnn-h100-reference.json"


def figures(results_dir: Path) -> dict:
    """{"device": ..., "rows": ..., "series": {mode: {"mmad"|"PyTorch"|"tiny-cuda-nn": [M samples/s per model]}},
    "variants": {model: backend}} read from the two JSON files; a model or mode missing from either is an error
    naming the file."""
    kernels_path = results_dir / KERNELS_FILE
    tcnn_path = results_dir / TCNN_FILE
    kernels = json.loads(kernels_path.read_text(encoding="utf-8"))
    tcnn = json.loads(tcnn_path.read_text(encoding="utf-8"))
    rows = {(r["model"], r["mode"]): r for r in kernels["results"] if "samples_per_s" in r}
    series: dict[str, dict[str, list[float]]] = {}
    variants: dict[str, str] = {}
    for mode in MODES:
        mmad, torch, ref = [], [], []
        for model in MODELS:
            row = rows.get((model, mode))
            if row is None:
                raise SystemExit(f"{kernels_path}: no measured {mode} row for model {model}")
            if not row.get("peer_seconds"):
                raise SystemExit(f"{kernels_path}: the {mode} row of model {model} has no PyTorch peer figure")
            try:
                ref_msps = tcnn["models"][model][f"{mode}_msps"]
            except KeyError:
                raise SystemExit(f"{tcnn_path}: no {mode}_msps for model {model}") from None
            mmad.append(row["samples_per_s"] / 1e6)
            torch.append(row["rows"] / row["peer_seconds"] / 1e6)
            ref.append(float(ref_msps))
            variants[model] = row["backend"]
        series[mode] = {"mmad": mmad, "PyTorch": torch, "tiny-cuda-nn": ref}
    device = next(iter(rows.values()))["device"]
    if tcnn.get("device") != device:
        raise SystemExit(f"{tcnn_path} was measured on {tcnn.get('device')!r}, {kernels_path} on {device!r}: "
                         "the chart compares one GPU kind")
    return {"device": device, "rows": kernels["rows"], "series": series, "variants": variants}


def draw(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"mmad": "#1f6feb", "PyTorch": "#ee4c2c", "tiny-cuda-nn": "#76b900"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.27
    for ax, mode in zip(axes, MODES):
        for i, (name, values) in enumerate(data["series"][mode].items()):
            xs = [m + (i - 1) * width for m in range(len(MODELS))]
            bars = ax.bar(xs, values, width, label=name, color=colours[name])
            for bar, v in zip(bars, values):
                ax.annotate(f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                            fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xticks(range(len(MODELS)))
        ax.set_xticklabels([f"{m}\n{data['variants'][m].split(':', 1)[-1]}" for m in MODELS], fontsize=8)
        ax.set_title("forward, fp16 I/O" if mode == "forward" else "training step (forward, backward, Adam)")
        ax.set_ylabel("million samples/s (log scale)")
        ax.grid(axis="y", which="major", alpha=0.3)
    axes[0].legend(loc="upper right", fontsize=8)
    fig.suptitle(f"Small-MLP kernels on an {data['device']}, batch {data['rows']:,} "
                 "(mmad: the cuda backend's chosen variant)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results",
                   help=f"folder holding {KERNELS_FILE} and {TCNN_FILE} (default bench/results)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.png", help="PNG to write (default docs/benchmarks.png)")
    args = p.parse_args(argv)
    draw(figures(args.results_dir), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
