"""The ``mmad`` command: probe, serve, bench, demo, cache, export.

Each subcommand returns an exit status; errors from the :mod:`mmad.errors` tree are printed in
one line (``mmad: error: ...``) with status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from mmad import __version__
from mmad.demo import IMAGE_CONFIG, demo_field
from mmad.errors import MMADError


def _probe(args: argparse.Namespace) -> int:
    from mmad.backends import ENV_VAR, choose, parse_forced, probe_all

    forced = parse_forced()  # validates MMAD_BACKEND before anything is probed
    started = time.perf_counter()
    rows = probe_all(args.backend or None)
    elapsed = time.perf_counter() - started
    chosen = choose(rows, forced)
    if chosen is not None:
        note = ("forced by " + ENV_VAR) if forced else "the best available; " + ENV_VAR + " overrides"
        if args.backend and not forced:
            note += "; among the backends probed here only"
        summary = f"selected: {chosen.backend}:{chosen.variant} on {chosen.device} ({note})"
    elif forced:
        summary = (f"selected: none: {ENV_VAR}={':'.join(p for p in forced if p)} cannot run here, "
                   "so `mmad serve` refuses to start")
    else:
        summary = "selected: none of the backends probed here can run"
    if args.json:
        print(json.dumps({"rows": [{**r.to_json(), "selected": r is chosen} for r in rows],
                          "selected": None if chosen is None else {"backend": chosen.backend,
                                                                   "variant": chosen.variant},
                          "summary": summary, "seconds": round(elapsed, 3),
                          "forced": list(forced) if forced else None}, indent=2))
        return 0
    header = ("backend", "variant", "status", "selected", "device", "api", "capabilities / reason")
    table = []
    for r in rows:
        if r.available:
            caps = ", ".join(str(s) for s in r.mma_shapes) or ", ".join(
                f"{k}={v}" for k, v in r.details.items() if not isinstance(v, (list, dict)))
            if r.software:
                caps = "software device (used only when forced); " + caps
        else:
            caps = r.reason
        table.append((r.backend, r.variant, "PASS" if r.available else "FAIL", "*" if r is chosen else "",
                      r.device, r.api_version, caps))
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(6)]
    for row in [header, *table]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + str(row[6]))
    listed = set()
    for r in rows:  # a backend that sees several devices lists them (models can go on each)
        devices = r.details.get("devices")
        if devices and r.backend not in listed:
            listed.add(r.backend)
            print(f"{r.backend} devices: " + "; ".join(map(str, devices)))
    print(summary)
    print(f"({elapsed:.2f} s)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Train a small MLP on a 2-D field with the best available backend and report it."""
    if args.image:
        return _demo_image(args)
    if args.torch:
        print("mmad demo: --torch trains the --image demo through mmad.torch; add --image", file=sys.stderr)
        return 2
    import numpy as np

    from mmad.backends import select
    from mmad.spec import MLPSpec

    backend, row = select()
    spec = MLPSpec.from_json({
        "n_input_dims": 2, "n_output_dims": 3,
        "network": {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
                    "n_neurons": 64, "n_hidden_layers": 3},
        "encoding": {"otype": "Frequency", "n_frequencies": 6},
        "loss": {"otype": "L2"}, "optimizer": {"otype": "Adam", "learning_rate": 1e-2},
        "precision": "fp16", "seed": 1337})
    model = backend.compile(spec, variant=row.variant)
    rng = np.random.default_rng(0)
    print(f"backend: {row.backend}:{row.variant} on {row.device}")
    batch = args.batch
    started = time.perf_counter()
    loss = float("nan")
    for step in range(1, args.steps + 1):
        x = rng.random((batch, 2), dtype=np.float32)
        y = demo_field(x)
        loss = float(model.train_step(x, y)[0])
        if step % max(1, args.steps // 10) == 0 or step == args.steps:
            print(f"step {step:5d}  loss {loss:.5f}")
    model.synchronize()
    elapsed = time.perf_counter() - started
    print(f"trained {args.steps} steps of {batch} samples in {elapsed:.2f} s: "
          f"{args.steps * batch / elapsed / 1e6:.3f} M samples/s, final loss {loss:.5f}")
    model.close()
    backend.close()
    return 0


def demo_image(size: int):
    """A size × size RGB picture in [0, 1], generated (no download): rings, a checkerboard whose
    squares shrink to the right, a colour ramp and a sharp-edged disc: detail at every scale."""
    import numpy as np

    u, v = np.meshgrid((np.arange(size) + 0.5) / size, (np.arange(size) + 0.5) / size, indexing="xy")
    rings = 0.5 + 0.5 * np.cos(60 * np.hypot(u - 0.35, v - 0.6))
    squares = (np.floor(u * (4 + 20 * u)) + np.floor(v * 12)) % 2
    disc = np.hypot(u - 0.7, v - 0.3) < 0.18
    red = np.where(disc, 1.0, rings)
    green = np.where(disc, 0.2, 0.1 + 0.8 * squares)
    blue = np.where(disc, 0.1, u * (1 - v) + 0.3 * v)
    return np.stack([red, green, blue], -1).astype(np.float32)


def _demo_image(args: argparse.Namespace) -> int:
    """Fit a generated picture with the hash-grid image config on ``--backend`` (cpu by default:
    it runs everywhere; cuda, vulkan or wgpu on a GPU), or with ``--torch`` through mmad.torch
    and torch's Adam; write the reconstruction and the loss/PSNR curve as PNGs."""
    import numpy as np
    from tqdm import tqdm

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("mmad demo --image draws its PNGs with matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    from mmad.errors import MMADError

    doc = {**IMAGE_CONFIG, "encoding": {**IMAGE_CONFIG["encoding"], "log2_hashmap_size": args.log2_hashmap_size}}
    image = demo_image(args.size)
    pixels = image.reshape(-1, 3)
    centres = (np.arange(args.size, dtype=np.float32) + 0.5) / args.size
    u, v = np.meshgrid(centres, centres, indexing="xy")
    coords = np.stack([u.ravel(), v.ravel()], 1)
    try:
        fitter = _TorchImageFit(doc, args) if args.torch else _BackendImageFit(doc, args)
    except MMADError as exc:
        print(f"mmad demo --image --{'torch' if args.torch else 'backend ' + str(args.backend)}: {exc}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    batch = min(args.batch, len(coords))
    rows_in_table = fitter.spec.grid_shapes["grid0"][0]
    print(f"fitting a {args.size}x{args.size} picture: HashGrid 16 levels x 2 features, 2^{args.log2_hashmap_size} "
          f"table ({rows_in_table:,} rows), 64x2 ReLU MLP, {fitter.what}, batch {batch}")

    def psnr() -> float:
        out = np.clip(fitter.predict(coords), 0, 1)
        return float(10 * np.log10(1 / np.mean((out - pixels) ** 2)))

    steps, losses, curve = [], [], []
    every = max(1, args.steps // 20)
    with tqdm(range(1, args.steps + 1), desc="training", unit="step") as bar:
        for step in bar:
            rows = rng.integers(0, len(coords), batch)
            losses.append(fitter.step(coords[rows], pixels[rows]))
            if step % every == 0 or step == args.steps:
                steps.append(step)
                curve.append(psnr())
                bar.set_postfix(loss=f"{losses[-1]:.5f}", psnr=f"{curve[-1]:.2f} dB")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    recon = np.clip(fitter.predict(coords), 0, 1).reshape(image.shape)
    fig, axes = plt.subplots(1, 2, figsize=(8, 4.3))
    for ax, picture, title in zip(axes, (image, recon), ("reference", f"mmad, {curve[-1]:.2f} dB PSNR")):
        ax.imshow(picture, interpolation="nearest")
        ax.set_title(title)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out_dir / "demo-image-reconstruction.png", dpi=100)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.semilogy(range(1, len(losses) + 1), losses, color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (L2)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(steps, curve, color="tab:red", marker="o", markersize=3)
    ax2.set_ylabel("PSNR of the whole picture (dB)", color="tab:red")
    fig.tight_layout()
    fig.savefig(out_dir / "demo-image-curve.png", dpi=100)
    print(f"wrote {out_dir / 'demo-image-reconstruction.png'} and {out_dir / 'demo-image-curve.png'}")
    print(f"final PSNR {curve[-1]:.2f} dB after {args.steps} steps")
    fitter.close()
    return 0


class _BackendImageFit:
    """The image fit on an mmad backend: its own training step (loss and Adam on the device)."""

    def __init__(self, doc: dict, args: argparse.Namespace):
        from mmad.backends import select
        from mmad.spec import MLPSpec

        self.backend, row = select(args.backend)
        if row.backend == "cuda":  # its mma variant computes in fp16 (tcnn's own precision for this config)
            doc = {**doc, "precision": "fp16"}
        self.spec = MLPSpec.from_json(doc)
        # a named variant is compiled as named; else the backend picks the one for a grid model
        self.model = self.backend.compile(self.spec, variant=row.variant if ":" in (args.backend or "") else None)
        self.what = f"{row.backend}:{self.model.variant} on {row.device}"

    def step(self, x, y) -> float:
        return float(self.model.train_step(x, y)[0])

    def predict(self, x):
        return self.model.forward(x)

    def close(self) -> None:
        self.model.close()
        self.backend.close()


class _TorchImageFit:
    """The image fit through mmad.torch: a NetworkWithInputEncoding (fp16; CUDA tensors where torch
    has a GPU, else CPU tensors on mmad's cpu backend), the L2 loss computed in torch, torch's Adam
    with the config's rates on the fp32 params."""

    def __init__(self, doc: dict, args: argparse.Namespace):
        try:
            import torch
        except ImportError as exc:
            from mmad.errors import MMADError

            raise MMADError(f"needs PyTorch ({exc}): pip install mmad[torch]") from exc
        import mmad.torch as mt
        from mmad.spec import MLPSpec

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.module = mt.NetworkWithInputEncoding(2, 3, doc["encoding"], doc["network"], seed=doc["seed"]).to(self.device)
        self.spec = self.module.spec
        opt = doc["optimizer"]
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=opt["learning_rate"],
                                          betas=(opt["beta1"], opt["beta2"]), eps=opt["epsilon"])
        self.what = f"mmad.torch on {self.device} (torch {torch.__version__}, Adam in torch)"
        MLPSpec.from_json(doc)  # the config as the backends read it: the same errors

    def step(self, x, y) -> float:
        torch = self.torch
        self.optimizer.zero_grad()
        pred = self.module(torch.from_numpy(x).to(self.device)).float()
        loss = ((pred - torch.from_numpy(y).to(self.device)) ** 2).mean()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def predict(self, x):
        with self.torch.no_grad():
            return self.module(self.torch.from_numpy(x).to(self.device)).float().cpu().numpy()

    def close(self) -> None:
        pass


def _bench(args: argparse.Namespace) -> int:
    from mmad.bench.kernels import main as bench_main

    return bench_main(args)


def _serve(argv: list[str]) -> int:
    from mmad.server.main import main as serve_main

    return serve_main(argv)


def _cache(args: argparse.Namespace) -> int:
    from mmad.backends.cache import KernelCache

    cache = KernelCache()
    if args.action == "warm":
        return _warm_cache(args, cache)
    if args.action == "clear":
        print(f"removed {cache.clear()} entries from {cache.directory}")
    else:
        print(_cache_summary(cache))
    return 0


def _cache_summary(cache) -> str:
    entries = list(cache.directory.glob("*/*.bin")) if cache.directory.exists() else []
    return f"{cache.directory}: {len(entries)} entries, {sum(p.stat().st_size for p in entries) / 1e6:.1f} MB"


def _warm_cache(args: argparse.Namespace, cache) -> int:
    """Compile the models asked for as the daemon would (its backend, the variant MMAD_BACKEND names,
    its max_batch_rows), and wait for each dispatch decision: the kernels and the decisions land
    in the kernel cache."""
    from mmad.backends import parse_forced, select
    from mmad.backends.dispatch import settled
    from mmad.engine.registry import DEMO_NAME, DEMO_SPEC
    from mmad.settings import Settings
    from mmad.spec import MLPSpec, bench_spec

    everything = not (args.bench_models or args.demo or args.config)
    specs = {}
    if args.bench_models or everything:
        specs.update({name: bench_spec(name) for name in ("S", "M", "L", "W")})
    if args.demo or everything:
        specs[DEMO_NAME] = MLPSpec.from_json(DEMO_SPEC)
    for path in map(Path, args.config):
        specs[path.stem] = MLPSpec.from_json(path.read_text())
    backend, row = select(args.backend)
    forced = parse_forced(args.backend)
    rows = args.batch_rows or Settings().max_batch_rows
    began = time.perf_counter()
    for name, spec in specs.items():
        started = time.perf_counter()
        model = settled(backend.compile(spec, variant=forced[1] if forced else None, cache=cache, batch_rows=rows))
        print(f"{name}: {row.backend}:{model.variant} in {time.perf_counter() - started:.1f} s", flush=True)
        model.close()
    print(f"warmed {len(specs)} models in {time.perf_counter() - began:.1f} s; {_cache_summary(cache)}")
    backend.close()
    return 0


def _export(args: argparse.Namespace) -> int:
    import httpx

    try:
        if args.to == "repository":
            return _export_repository(args)
        if args.url or args.output_dir:
            raise ValueError("--url and a positional folder go with --to repository; give the file with -o")
        if not args.config or not args.output:
            raise ValueError(f"--to {args.to} needs --config and -o/--output")
        return _export_files(args)
    except httpx.HTTPError as exc:
        print(f"mmad: error: the daemon at {args.url} could not be read: {exc}", file=sys.stderr)
        return 2
    # a file that cannot be read or parsed, or an optional package (mmad[export]) that is missing
    except (OSError, ImportError, ValueError) as exc:
        print(f"mmad: error: {exc}", file=sys.stderr)
        return 2


def _export_files(args: argparse.Namespace) -> int:
    from pathlib import Path

    from safetensors.numpy import save_file

    from mmad import export

    spec, _config = _export_config(args)
    params = _export_params(args, spec)
    out = Path(args.output)
    if args.to == "onnx":
        out.write_bytes(export.to_onnx(spec, params))
    elif args.to == "safetensors":
        save_file(params, str(out))
    else:
        export.require_optional("torch").save(export.to_torch(spec, params).state_dict(), out)
    print(f"wrote {out} ({args.to}, {out.stat().st_size} bytes)")
    return 0


def _export_config(args: argparse.Namespace):
    """(spec, serving config) of --config: a tiny-cuda-nn JSON config, or a store's model.json
    (the config under "spec", the serving config under "config")."""
    from pathlib import Path

    from mmad.engine.registry import ModelConfig
    from mmad.spec import MLPSpec

    doc = json.loads(Path(args.config).read_text())
    if isinstance(doc, dict) and "spec" in doc:
        return MLPSpec.from_json(doc["spec"]), ModelConfig.parse(doc.get("config"))
    return MLPSpec.from_json(doc), ModelConfig()


def _export_params(args: argparse.Namespace, spec):
    """The inference weights of the file source given (--params, --tcnn-params or --state-dict)."""
    from pathlib import Path

    import numpy as np
    from safetensors.numpy import load_file

    from mmad import export

    if args.params:
        state = load_file(args.optimizer_state) if args.optimizer_state else None
        params = export.inference_params(spec, load_file(args.params), state)
    elif args.tcnn_params:
        path = Path(args.tcnn_params)
        params = export.from_tcnn(spec, np.load(path) if path.suffix == ".npy" else path.read_bytes(), args.tcnn_dtype)
    else:
        path = Path(args.state_dict)
        if path.suffix == ".safetensors":
            state_dict = load_file(path)
        else:
            state_dict = export.require_optional("torch").load(path, map_location="cpu", weights_only=True)
        params = export.from_state_dict(spec, state_dict)
    return params


def _export_repository(args: argparse.Namespace) -> int:
    """Versions of a model into a model repository folder (Triton's layout), from a running
    daemon (--url) or from files (--config and a weights source)."""
    from pathlib import Path

    from mmad.engine.repository import newest_published, publish_versions

    if bool(args.output) == bool(args.output_dir):
        raise ValueError("--to repository needs the repository folder, once: mmad export --to repository DIR "
                         "(or -o DIR)")
    root = Path(args.output or args.output_dir)
    if not args.model:
        raise ValueError("--to repository needs --model NAME: the model's folder in the repository (with --url, "
                         "also the daemon's model)")
    if args.url:
        if args.config or args.optimizer_state:
            raise ValueError("--url reads the model's config and weights from the daemon: leave out --config and "
                             "--optimizer-state")
        spec, config, versions = _daemon_versions(args.url, args.model, args.version or ["latest"])
    else:
        if not args.config:
            raise ValueError("--to repository from files needs --config (the model's tiny-cuda-nn JSON, or a "
                             "store's model.json) and one weights source; or --url to read a running daemon")
        spec, config = _export_config(args)
        if args.version and (len(args.version) > 1 or not args.version[0].isdigit()):
            raise ValueError("from files, --version is the one version number to write (default: the repository's "
                             "newest plus one)")
        number = int(args.version[0]) if args.version else newest_published(root, args.model) + 1
        versions = {number: _export_params(args, spec)}
    for folder in publish_versions(root, args.model, spec, config, versions):
        print(f"wrote {folder} (model {args.model} version {folder.name})")
    return 0


def _daemon_versions(url: str, model: str, wanted: list[str]):
    """(spec, serving config, {version: weights}) of ``model`` on the daemon at ``url``: the
    versions ``wanted`` (numbers, 'latest' or 'all')."""
    import httpx
    from safetensors.numpy import load as st_load

    from mmad.errors import InvalidInput
    from mmad.engine.registry import ModelConfig
    from mmad.spec import MLPSpec

    with httpx.Client(base_url=url.rstrip("/"), timeout=60.0) as http:
        meta = http.get(f"/v2/models/{model}")
        if meta.status_code != 200:
            try:
                why = meta.json()["error"]
            except (ValueError, KeyError, TypeError):
                why = meta.text[:200]
            raise InvalidInput(f"the daemon at {url} answered {meta.status_code} for model {model!r}: {why}")
        doc = meta.json()
        spec, config = MLPSpec.from_json(doc["spec"]), ModelConfig.parse(doc.get("config"))
        if spec.optimizer.ema is not None:
            raise InvalidInput(f"model {model!r} infers with the averaged weights of its EMA optimizer, which the "
                               "daemon's API does not give: export each version from its store files (--config "
                               "<store>/models/NAME/model.json --params .../weights/V.safetensors --optimizer-state "
                               ".../optimizer/V.safetensors --version V)")
        listed = [v["version"] for v in http.get(f"/v2/models/{model}/versions").raise_for_status().json()["versions"]]
        if "all" in wanted:
            picked = listed
        else:
            picked = sorted({listed[-1] if w == "latest" else w for w in wanted}, key=int)
            missing = [v for v in picked if v not in listed]
            if missing:
                raise InvalidInput(f"model {model!r} on {url} has no version {', '.join(missing)} (it has "
                                   f"{', '.join(listed)})")
        versions = {}
        for v in picked:
            body = http.get(f"/v2/models/{model}/weights", params={"version": v}).raise_for_status().content
            versions[int(v)] = st_load(body)
    return spec, config, versions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmad", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"mmad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("probe", help="print what every backend can do here (PASS/FAIL with reasons)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--backend", action="append", choices=["cuda", "vulkan", "wgpu", "cpu"],
                   help="probe only this backend (repeatable)")
    p.set_defaults(func=_probe)

    sub.add_parser("serve", help="run the HTTP daemon (see `mmad serve --help`)", add_help=False)

    p = sub.add_parser("bench", help="kernel throughput of the S/M/L/W models against PyTorch and the hardware "
                                     "floor (docs/benchmarks.md); `mmad bench --service [...]` runs the HTTP load "
                                     "benchmark instead",
                       description="Kernel throughput of the S/M/L/W models against PyTorch and the hardware floor "
                                   "(docs/benchmarks.md). `mmad bench --service [options]` runs the HTTP load "
                                   "benchmark against the daemon instead (docs/service-performance.md); "
                                   "`mmad bench --service --help` lists its options. `mmad bench --jobs [options]` "
                                   "times training jobs through the daemon against in-process training and "
                                   "PyTorch (docs/benchmarks.md); `mmad bench --jobs --help` lists its options. "
                                   "`mmad bench --multi-gpu [options]` times replicas and data-parallel training "
                                   "over two devices (docs/multi-gpu.md). `mmad bench --hashgrid [options]` times "
                                   "tiny-cuda-nn's hash-grid image config against PyTorch and tiny-cuda-nn's "
                                   "figures (docs/benchmarks.md); `mmad bench --hashgrid --help` lists its options. "
                                   "`mmad bench --ready [options]` times a model's PUT to READY and to its first "
                                   "answer, cold and warm cache (docs/benchmarks.md); `mmad bench --ready --help` "
                                   "lists its options. "
                                   "`mmad bench --torch [options]` times mmad.torch's forward + backward from an "
                                   "outside gradient against mmad.export.to_torch (docs/torch.md).")
    p.add_argument("--backend", action="append", metavar="NAME[:VARIANT]",
                   help="cpu, cuda[:VARIANT] (mma, mma-f16acc, cublaslt, wgmma, ...: `mmad probe`), "
                        "vulkan[:coopmat2|coopmat|simt], wgpu; repeatable or "
                        "comma-separated (default: MMAD_BACKEND, else the best available)")
    p.add_argument("--models", default="S,M,L,W", help="comma-separated subset of S,M,L,W")
    p.add_argument("--rows", type=int, help="batch rows (default 2^20 on a GPU, 2^16 on the CPU)")
    p.add_argument("--io", choices=("fp16", "fp32"),
                   help="forward input and output type (default fp16; fp32 on vulkan and wgpu, whose device "
                        "arrays are float32); training always takes fp32 inputs and targets")
    p.add_argument("--mode", choices=("forward", "train", "both"), default="both", help="what to time (default both)")
    p.add_argument("--peer", choices=("torch", "none"), default="torch",
                   help="PyTorch in the same run (fp16 with CUDA graphs on CUDA, float32 on the CPU), or none")
    p.add_argument("--repeats", type=int, default=20, help="timed samples per figure (median reported)")
    p.add_argument("--json", metavar="PATH", help="write the rows, peers and floor as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    p.add_argument("--dispatch", metavar="PATH",
                   help="write, per model, the variant the backend chose by measurement (--backend without a "
                        "variant, e.g. cuda), its forward and training figures, the same-run PyTorch figures and "
                        "the dispatcher's own timings as JSON (e.g. bench/results/dispatch-h100.json)")
    p.add_argument("--profile", action="store_true",
                   help="per-op GPU times as well: CUDA events per kernel (cuda), GPU timestamps per dispatch "
                        "and pipeline statistics (vulkan)")
    g = p.add_argument_group("checks that run instead of the benchmark")
    g.add_argument("--daemon-check", action="store_true",
                   help="`mmad serve` on --backend (default cuda) end to end: model M created over HTTP, binary "
                        "inference checked against the float64 oracle, 20 training steps")
    g.add_argument("--sass", metavar="DIR", help="cuda: instruction mix of the mma kernels of S/M/L (or, with "
                                                 "--backend cuda:wgmma, the wgmma forwards of S/M/L/W and "
                                                 "training kernels of S/M/L) from "
                                                 "cuobjdump; cubins and SASS listings go to DIR")
    g.add_argument("--nvmath-check", action="store_true",
                   help="cuda: what nvmath-python's cuBLASLt epilogs accept and compute here")
    g.add_argument("--run-forward", metavar="MODEL:VARIANT",
                   help="cuda: compile MODEL and run its forward 4 times at --rows rows of --io, nothing else "
                        "(the workload for an outside profiler such as ncu or compute-sanitizer), e.g. S:wgmma")
    g.add_argument("--run-train", metavar="MODEL:VARIANT",
                   help="cuda: compile MODEL and run 2 training steps on --rows random rows, then 2 over a "
                        "device dataset of them, nothing else (a compute-sanitizer workload), e.g. L:wgmma")
    p.set_defaults(func=_bench)

    p = sub.add_parser("demo", help="train a small MLP with the best available backend; --image: fit a "
                                    "generated picture with tiny-cuda-nn's hash-grid config")
    p.add_argument("--steps", type=int, default=300,
                   help="training steps (Adam updates) to run (default 300)")
    p.add_argument("--batch", type=int, default=4096,
                   help="rows per step: random points of the field, or with --image random pixels of the "
                        "picture (default 4096)")
    p.add_argument("--image", action="store_true", help="fit a picture with the HashGrid image config; writes "
                                                        "demo-image-reconstruction.png and demo-image-curve.png")
    p.add_argument("--size", type=int, default=128, help="--image: the picture's side in pixels")
    p.add_argument("--log2-hashmap-size", type=int, default=15, help="--image: the hash table's size (log2)")
    p.add_argument("--torch", action="store_true", help="--image: train through mmad.torch (a PyTorch module, "
                                                        "torch's Adam, the loss in torch; docs/torch.md)")
    p.add_argument("--out", default=".", help="--image: the folder for the PNGs")
    p.add_argument("--backend", default="cpu",
                   help="--image: the backend[:variant] that trains it (default cpu; grids run on cpu, cuda, wgpu "
                        "and vulkan)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("export", help="a model as ONNX, a PyTorch state dict or mmad's safetensors weights; "
                                      "imports tiny-cuda-nn parameters and nn.Sequential state dicts (docs/export.md)",
                       description="Write a model, given by its config and one source of weights, as an ONNX file, "
                                   "a PyTorch state dict or mmad's safetensors weights. The weights come from mmad "
                                   "(--params: a store version's weights file, or GET /v2/models/NAME/weights), "
                                   "from tiny-cuda-nn (--tcnn-params: its flat parameter buffer) or from PyTorch "
                                   "(--state-dict of an nn.Sequential of Linear layers); --to safetensors turns "
                                   "the last two into weights for PUT /v2/models/NAME/weights. The exported "
                                   "forward is mmad's fp32 forward (docs/export.md). --to repository publishes "
                                   "versions of a model (from a running daemon with --url, or from files) into a "
                                   "model repository folder that serving daemons follow with `mmad serve "
                                   "--model-repository DIR --model-control-mode poll`; each version folder appears "
                                   "whole (docs/service.md).")
    p.add_argument("--config",
                   help="the model's tiny-cuda-nn JSON config, or a model store's model.json")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="--to repository: read the model (--model) from the daemon at this address, "
                                   "e.g. http://127.0.0.1:8000")
    src.add_argument("--params", metavar="FILE", help="mmad weights (.safetensors: a store version's "
                                                     "weights/<v>.safetensors or GET .../weights)")
    src.add_argument("--tcnn-params", metavar="FILE",
                     help="tiny-cuda-nn's flat parameter buffer: raw values (--tcnn-dtype) or a .npy array")
    src.add_argument("--state-dict", metavar="FILE",
                     help="a state dict of a plain nn.Sequential of Linear layers (.pt, or .safetensors)")
    p.add_argument("--optimizer-state", metavar="FILE",
                   help="with --params: the version's optimizer state, needed for an EMA optimizer (it infers "
                        "with the averaged weights)")
    p.add_argument("--tcnn-dtype", choices=("fp16", "fp32"), default="fp16",
                   help="the raw buffer's values (default fp16, tiny-cuda-nn's network precision)")
    p.add_argument("--to", choices=("onnx", "state-dict", "safetensors", "repository"), required=True,
                   help="onnx (needs the onnx package), state-dict (torch.save of the PyTorch module's state "
                        "dict; needs torch), safetensors (mmad's weights, for PUT .../weights) or repository "
                        "(a model repository folder: DIR/MODEL/config.json, mmad.json, VERSION/model.safetensors, "
                        "for mmad serve --model-repository DIR)")
    p.add_argument("-o", "--output", help="the file to write (--to repository: the repository folder)")
    p.add_argument("output_dir", nargs="?", metavar="DIR", help="--to repository: the repository folder")
    p.add_argument("--model", help="--to repository: the model's name (its folder; with --url, the daemon's model)")
    p.add_argument("--version", action="append",
                   help="--to repository: with --url, a version of the daemon's model to publish (repeatable; "
                        "'all', or 'latest', the default); from files, the version number to write (default: "
                        "the repository's newest plus one). A published version is never overwritten")
    p.set_defaults(func=_export)

    p = sub.add_parser("cache", help="inspect, clear or warm the kernel cache (MMAD_CACHE_DIR)",
                       description="info: the cache's entries and size; clear: remove them; warm: compile models "
                                   "on the daemon's backend and, where it measures its variants (cuda), measure "
                                   "them, so that a daemon on this cache serves them at once on their chosen "
                                   "variants (the bench models S/M/L/W with --bench-models, the demo model with "
                                   "--demo, tiny-cuda-nn configs with --config; none given: all but the configs)")
    p.add_argument("action", choices=["info", "clear", "warm"])
    p.add_argument("--bench-models", action="store_true", help="warm: the benchmark models S, M, L, W")
    p.add_argument("--demo", action="store_true", help="warm: the daemon's demo model")
    p.add_argument("--config", action="append", default=[], metavar="PATH",
                   help="warm: a model's tiny-cuda-nn JSON config, with n_input_dims and n_output_dims (repeatable)")
    p.add_argument("--backend", metavar="NAME[:VARIANT]",
                   help="warm: the backend the daemon will run (default MMAD_BACKEND, else the best available)")
    p.add_argument("--batch-rows", type=int, metavar="N",
                   help="warm: the models' max_batch_rows, the batch their variants are measured at (default the "
                        "daemon's, MMAD_MAX_BATCH_ROWS)")
    p.set_defaults(func=_cache)
    return parser


# `mmad bench FLAG [options]`: a benchmark with options of its own, parsed by its module's main
BENCH_COMMANDS = {"--service": "mmad.bench.load", "--jobs": "mmad.bench.jobs", "--multi-gpu": "mmad.bench.multi_gpu",
                  "--hashgrid": "mmad.bench.hashgrid", "--ready": "mmad.bench.ready", "--torch": "mmad.bench.torch_bench"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "serve":
            return _serve(argv[1:])
        for flag, module in BENCH_COMMANDS.items():
            if argv[:1] == ["bench"] and flag in argv[1:]:
                return importlib.import_module(module).main([a for a in argv[1:] if a != flag])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except MMADError as exc:
        print(f"mmad: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
