"""Backward from an outside gradient and mmad.torch on the cuda backend, against the cpu oracles.

On a CUDA GPU (skipped without one, with the reason): the device encodings (every parameter-free
encoding, forward and input gradient) against mmad.backends.numerics; the contract's
forward_train / backward of the mma, wgmma and device-encoded (grid and mmad.torch) models against
the float64 and emulating cpu backends; mmad.torch's modules on CUDA tensors against the same
modules on CPU tensors, a tcnn checkpoint's outputs, torch's Adam following the oracle's loss
curve, torch's side streams and no synchronisation. Without a GPU the generated sources are
still built by nvcc (no spills) and the spherical harmonics' generated code is evaluated here
against the oracle's formula. Tolerances are tests/test_cuda.py's (docs/design.md, fp16).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from mmad.backends import numerics as nm
from mmad.backends.cpu import CpuBackend
from mmad.backends.cuda.encodings import FreePart, encoder_source, free_parts, spherical_harmonics_source
from mmad.backends.cuda.grids import GridPlan
from mmad.backends.cuda.mma import MmaPlan
from mmad.backends.encodings import spherical_harmonics
from mmad.errors import InvalidInput
from mmad.spec import MLPSpec
from oracle import case_rng, rel_err
from test_backward import random_params

FWD_TOL = 3e-3
GRAD_TOL_EMULATE = 2e-2  # the device sums in another order (mma accumulators, fp32 atomics into the tables)
GRID = {"n_levels": 6, "n_features_per_level": 2, "log2_hashmap_size": 10, "base_resolution": 4, "per_level_scale": 1.6}
ENCODINGS = {
    "identity": (4, {"otype": "Identity", "scale": 0.5, "offset": 0.25}),
    "frequency": (3, {"otype": "Frequency", "n_frequencies": 6}),
    "oneblob": (2, {"otype": "OneBlob", "n_bins": 32}),
    "triangle": (3, {"otype": "TriangleWave", "n_frequencies": 5}),
    "spherical": (3, {"otype": "SphericalHarmonics", "degree": 8}),
    "ngp": (6, {"otype": "Composite", "nested": [{"otype": "HashGrid", "n_dims_to_encode": 3, **GRID},
                                                 {"otype": "SphericalHarmonics", "degree": 4}]}),
    "grids": (5, {"otype": "Composite", "nested": [
        {"otype": "DenseGrid", "n_dims_to_encode": 2, **GRID, "interpolation": "Smoothstep"},
        {"otype": "OneBlob", "n_dims_to_encode": 1, "n_bins": 8},
        {"otype": "TiledGrid", "n_dims_to_encode": 2, "n_levels": 3, "base_resolution": 4, "interpolation": "Nearest"}]}),
}
NET = {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None", "n_neurons": 64,
       "n_hidden_layers": 2}


def make_spec(encoding: str, net=None, n_out=3) -> MLPSpec:
    n_in, enc = ENCODINGS[encoding]
    return MLPSpec.from_json({"n_input_dims": n_in, "n_output_dims": n_out, "encoding": enc, "network": net or NET,
                              "precision": "fp16"})


def unit_rows(rng, rows, dims):
    return rng.uniform(0.02, 0.98, (rows, dims)).astype(np.float32)


@pytest.fixture(scope="module")
def cuda():
    from test_cuda import _cuda_backend

    backend = _cuda_backend()
    import cupy

    from mmad.backends.cuda.toolchain import device_info

    return backend, cupy, device_info(cupy)


def oracle(spec, params, mode):
    model = CpuBackend(mode).compile(spec)
    model.set_params(params)
    return model


def oracle_backward(spec, params, x, g, mode):
    model = oracle(spec, params, mode)
    _, ctx = model.forward_train(x.astype(np.float64) if mode == "float64" else x)
    return model.backward(ctx, g, want_input_grad=True)


def check_grads(spec, params, x, g, dx, grads, input_grad=True) -> None:
    """Each gradient within GRAD_TOL_EMULATE of the emulating oracle and, against float64, within
    the emulation's own distance from it plus that bound (fp16 ReLU masks: tests/oracle.py)."""
    ref_dx, ref = oracle_backward(spec, params, x, g, "float64")
    emu_dx, emu = oracle_backward(spec, params, x, g, "emulate")
    pairs = [(name, grads[name], ref[name], emu[name]) for name in ref]
    if input_grad:
        pairs.append(("input", dx, ref_dx, emu_dx))
    for name, got, want, emulated in pairs:
        got = np.asarray(got)
        if not np.abs(want).max() > 0:  # a Nearest grid's input gradient, an unused table row block: 0
            assert np.abs(got).max() == 0, name
            continue
        inherent = rel_err(emulated, want)
        assert rel_err(got, emulated) <= GRAD_TOL_EMULATE, (name, rel_err(got, emulated))
        assert rel_err(got, want) <= 1.25 * inherent + GRAD_TOL_EMULATE, (name, rel_err(got, want), inherent)


# -- device encodings --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("encoding", ["identity", "frequency", "oneblob", "triangle", "spherical"])
def test_device_encoding_matches_numerics(cuda, encoding):
    """The row-major fp32 encoding every non-pair variant reads (CudaModel._device_input) against
    numerics.encode in float64, on 2^16 fresh rows: fp32 rounding apart."""
    from mmad.backends.cuda.encodings import DeviceEncoder

    _, cp, info = cuda
    spec = make_spec(encoding)
    x = unit_rows(case_rng("device-encoding", encoding), 1 << 16, spec.n_input_dims)
    encoder = DeviceEncoder(spec, cp, f"{info['cc'][0]}{info['cc'][1]}")
    out = encoder.encode_rows(cp.asarray(x)).get()
    assert rel_err(out, nm.encode(spec.encoding, x.astype(np.float64))) <= 1e-5


@pytest.mark.gpu
def test_a_wide_oneblob_model_encodes_on_the_device(cuda):
    """A OneBlob model of 512 encoded columns on the mma variant: its forward of device rows is
    the oracle's (the encoding made by enc_forward_0, not on the host)."""
    backend, cp, _ = cuda
    spec = MLPSpec.from_json({"n_input_dims": 32, "n_output_dims": 4, "encoding": {"otype": "OneBlob", "n_bins": 16},
                              "network": NET, "precision": "fp16"})
    rng = case_rng("oneblob-512")
    params = random_params(spec, rng)
    x = unit_rows(rng, 1 << 14, 32)
    with backend.compile(spec, variant="mma") as m:
        m.set_params(params)
        out = m.forward(cp.asarray(x)).get()
        assert m._device_encoder is not None
    assert rel_err(out, oracle(spec, params, "float64").forward(x)) <= FWD_TOL


# -- the contract's backward ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_device_encoded_backward_matches_the_oracle(cuda, encoding):
    """forward_train / backward of a device-encoded model (mmad.torch's path, grid models'):
    the parameters' gradients and d loss / d input against the oracles, host arrays in and out."""
    from mmad.backends.cache import KernelCache
    from mmad.backends.cuda.grids import CudaGridModel

    _, cp, info = cuda
    spec = make_spec(encoding)
    rng = case_rng("cuda-backward", encoding)
    params = random_params(spec, rng)
    x = unit_rows(rng, 3000, spec.n_input_dims)
    g = rng.normal(size=(3000, 3)).astype(np.float32)
    with CudaGridModel(spec, cp, info, KernelCache()) as m:
        m.set_params(params)
        y, ctx = m.forward_train(x)
        assert rel_err(y, oracle(spec, params, "float64").forward(x)) <= FWD_TOL
        dx, grads = m.backward(ctx, g, want_input_grad=True)
        assert dx.shape == x.shape and set(grads) == set(params)
        check_grads(spec, params, x, g, dx, grads)
        # device arrays in: device arrays out, the same values
        y2, ctx2 = m.forward_train(cp.asarray(x))
        dx2, grads2 = m.backward(ctx2, cp.asarray(g), want_input_grad=True)
        assert isinstance(dx2, cp.ndarray) and rel_err(dx2.get(), dx) <= 1e-3
        m.set_params(params)
        with pytest.raises(InvalidInput, match="parameters changed after forward_train"):
            m.backward(ctx2, g)


@pytest.mark.gpu
@pytest.mark.parametrize("variant,activation", [("mma", "ReLU"), ("mma", "Tanh"), ("mma", "SiLU"), ("wgmma", "ReLU"),
                                                ("wgmma", "Tanh"), ("wgmma+mma", "ReLU")])
def test_mma_and_wgmma_backward_matches_the_oracle(cuda, variant, activation):
    """The parameters' gradients from an outside dL/dy on the plain variants (a Frequency encoding
    made on the device for them); d loss / d input is refused there, naming the models that have it."""
    backend, cp, _ = cuda
    rows = {r.variant: r for r in backend.probe()}
    if not rows[variant].available:
        pytest.skip(f"the {variant} variant is unavailable here: {rows[variant].reason}")
    spec = make_spec("frequency", net={**NET, "activation": activation})
    rng = case_rng("cuda-variant-backward", variant, activation)
    params = random_params(spec, rng)
    x = unit_rows(rng, 5000, spec.n_input_dims)
    g = rng.normal(size=(5000, 3)).astype(np.float32)
    with backend.compile(spec, variant=variant) as m:
        m.set_params(params)
        _, ctx = m.forward_train(x)
        dx, grads = m.backward(ctx, g)
        assert dx is None
        check_grads(spec, params, x, g, None, grads, input_grad=False)
        with pytest.raises(InvalidInput, match="d loss / d input comes from"):
            m.backward(ctx, g, want_input_grad=True)


# -- mmad.torch on CUDA tensors -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch_cuda(cuda):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install mmad[torch])")
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA (a CPU build): mmad.torch runs its CPU path only")
    return torch


def torch_module(torch, encoding, seed=3):
    import mmad.torch as mt

    n_in, enc = ENCODINGS[encoding]
    return mt.NetworkWithInputEncoding(n_in, 3, enc, NET, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("encoding", ["ngp", "frequency", "grids"])
def test_torch_module_on_cuda_matches_it_on_cpu(torch_cuda, encoding):
    """The same module (fp16) on CUDA and on CPU tensors: outputs, params' and inputs' gradients."""
    torch = torch_cuda
    rng = case_rng("torch-cuda", encoding)
    m = torch_module(torch, encoding)
    with torch.no_grad():
        m.params.copy_(torch.from_numpy(rng.uniform(-0.5, 0.5, m.params.shape)))
    x = torch.from_numpy(unit_rows(rng, 4000, m.n_input_dims))
    g = torch.from_numpy(rng.normal(size=(4000, 3)).astype(np.float32))
    results = []
    for device in ("cpu", "cuda"):
        m.params.grad = None
        m.to(device)
        xd = x.to(device).detach().requires_grad_()  # a leaf of its own on each device (x.to("cpu") is x)
        y = m(xd)
        assert y.dtype == torch.float16 and y.device.type == device
        (y.float() * g.to(device)).sum().backward()
        results.append((y.detach().float().cpu().numpy(), m.params.grad.cpu().numpy(), xd.grad.cpu().numpy()))
    (y_cpu, p_cpu, x_cpu), (y_gpu, p_gpu, x_gpu) = results
    assert rel_err(y_gpu, y_cpu) <= FWD_TOL
    assert rel_err(p_gpu, p_cpu) <= GRAD_TOL_EMULATE
    assert rel_err(x_gpu, x_cpu) <= GRAD_TOL_EMULATE


@pytest.mark.gpu
def test_torch_module_on_a_side_stream_without_synchronising(torch_cuda):
    """On a side stream the module's work is ordered on that stream (the result equals the
    default stream's), and forward + backward make torch synchronise nowhere."""
    torch = torch_cuda
    rng = case_rng("torch-stream")
    m = torch_module(torch, "ngp").cuda()
    x = torch.from_numpy(unit_rows(rng, 1 << 16, 6)).cuda()
    ref = m(x).float()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            y = m(x)
            xg = x.clone().requires_grad_()
            m(xg).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(y.float(), ref)
    assert torch.isfinite(xg.grad).all() and xg.grad.abs().sum() > 0


@pytest.mark.gpu
def test_torch_captured_steps_give_what_launching_each_kernel_gives(torch_cuda, monkeypatch):
    """A batch size seen again runs as captured CUDA graphs: every step's output and gradients
    (fresh random inputs and d loss / d output each step) are those of a module that launches
    every kernel; so are a backward after a later forward of the same size (run again eagerly)
    and a size interleaved with it."""
    torch = torch_cuda
    rng = case_rng("torch-cuda-graphs")
    modules = {}
    for graphs in ("1", "0"):
        monkeypatch.setenv("MMAD_CUDA_GRAPHS", graphs)
        m = torch_module(torch, "ngp")
        with torch.no_grad():
            m.params.copy_(torch.from_numpy(rng.uniform(-0.5, 0.5, m.params.shape)))
        m.cuda()(torch.zeros(8, m.n_input_dims, device="cuda"))  # the runner is built (with the knob) now
        modules[graphs] = m
    modules["0"].load_state_dict(modules["1"].state_dict())

    def step(m, x, dy):
        m.params.grad = None
        xg = x.clone().requires_grad_()
        y = m(xg)
        y.backward(dy)
        return y.detach().float(), m.params.grad.clone(), xg.grad.clone()

    def draw(rows):
        return (torch.from_numpy(unit_rows(rng, rows, 6)).cuda(),
                torch.from_numpy(rng.normal(size=(rows, 3)).astype(np.float16)).cuda())

    for rows in (3000, 3000, 3000, 1000, 3000, 1000, 1000, 3000):
        x, dy = draw(rows)
        ours, ref = step(modules["1"], x, dy), step(modules["0"], x, dy)
        assert torch.equal(ours[0], ref[0]), rows
        for got, want in zip(ours[1:], ref[1:]):  # the tables' fp32 atomics add in any order
            assert rel_err(got.cpu().numpy(), want.cpu().numpy()) <= 1e-3, rows
    assert modules["1"]._runners[("cuda:0", False)].captured_rows == [1000, 3000], "both sizes run as graphs"
    assert modules["0"]._runners[("cuda:0", False)].captured_rows == []
    # two forwards of the captured size, then the first one's backward
    m, x, dy = modules["1"], *draw(3000)
    xg = x.clone().requires_grad_()
    m.params.grad = None
    y_first = m(xg)
    m(draw(3000)[0])
    y_first.backward(dy)
    want = step(modules["0"], x, dy)
    assert rel_err(m.params.grad.cpu().numpy(), want[1].cpu().numpy()) <= 1e-3
    assert rel_err(xg.grad.cpu().numpy(), want[2].cpu().numpy()) <= 1e-3


@pytest.mark.gpu
def test_torch_tcnn_checkpoint_on_cuda(torch_cuda):
    from test_export import tcnn_buffer, tcnn_forward

    torch = torch_cuda
    rng = case_rng("torch-cuda-checkpoint")
    m = torch_module(torch, "ngp")
    mats, flat = tcnn_buffer(m.spec, seed=41)
    tables = [rng.uniform(-1, 1, shape) for shape in m.spec.grid_shapes.values()]
    flat = np.concatenate([flat] + [t.reshape(-1) for t in tables]).astype(np.float16)
    m.load_state_dict({"params": torch.from_numpy(flat.astype(np.float32))})
    m.cuda()
    x = unit_rows(rng, 2000, 6)
    with torch.no_grad():
        out = m(torch.from_numpy(x).cuda()).float().cpu().numpy()
    expected = tcnn_forward(m.spec, [a.astype(np.float16).astype(np.float64) for a in mats], x,
                            [t.astype(np.float16).astype(np.float64) for t in tables], pad=1.0)
    assert rel_err(out, expected) <= FWD_TOL


@pytest.mark.gpu
def test_torch_adam_on_cuda_follows_the_oracles_loss_curve(torch_cuda):
    torch = torch_cuda
    rng = case_rng("torch-cuda-train")
    x = torch.from_numpy(unit_rows(rng, 2048, 6))
    target = torch.stack([torch.sin(6 * x[:, 0]) * x[:, 3], x[:, 1] * x[:, 2], torch.cos(4 * x[:, 4] + x[:, 5])], 1)

    def train(m, device, dtype):
        m.to(device)
        optimizer = torch.optim.Adam(m.parameters(), lr=5e-3, eps=1e-15)
        xs, ts = x.to(device, dtype), target.to(device, dtype)
        losses = []
        for _ in range(200):
            optimizer.zero_grad()
            loss = ((m(xs).to(dtype) - ts) ** 2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return torch.stack(losses).cpu().double().numpy()

    ref = train(torch_module(torch, "ngp", seed=5).double(), "cpu", torch.float64)
    ours = train(torch_module(torch, "ngp", seed=5), "cuda", torch.float32)
    assert ref[-1] < 0.5 * ref[0]
    assert np.abs(ours - ref).max() / ref[0] < 5e-2, np.abs(ours - ref).max()


@pytest.mark.gpu
def test_torch_encoding_on_cuda_matches_it_on_cpu(torch_cuda):
    import mmad.torch as mt

    torch = torch_cuda
    rng = case_rng("torch-cuda-encoding")
    enc = mt.Encoding(6, ENCODINGS["ngp"][1])
    with torch.no_grad():
        enc.params.copy_(torch.from_numpy(rng.uniform(-1, 1, enc.params.shape)))
    x = torch.from_numpy(unit_rows(rng, 3000, 6))
    g = torch.from_numpy(rng.normal(size=(3000, enc.n_output_dims)).astype(np.float32))
    results = []
    for device in ("cpu", "cuda"):
        enc.params.grad = None
        enc.to(device)
        xd = x.to(device).detach().requires_grad_()  # a leaf of its own on each device (x.to("cpu") is x)
        y = enc(xd)
        (y.float() * g.to(device)).sum().backward()
        results.append((y.detach().float().cpu().numpy(), enc.params.grad.cpu().numpy(), xd.grad.cpu().numpy()))
    for a, b in zip(*results):
        assert rel_err(b, a) <= GRAD_TOL_EMULATE


# -- without a GPU: the generated sources ------------------------------------------------------------------
def test_generated_spherical_harmonics_are_the_oracles():
    """The statements spherical_harmonics_source generates, evaluated here (fp32 literals as Python
    floats, T as float64 arrays), give the oracle's formula for every degree."""
    rng = case_rng("sh-codegen")
    x = rng.uniform(0, 1, (100, 3))
    for degree in range(1, 9):
        code = spherical_harmonics_source("sh", degree)
        body = code.split("{", 1)[1].rsplit("}", 1)[0]
        env = {"x0": x[:, 0], "x1": x[:, 1], "x2": x[:, 2], "out": {}}
        for line in body.strip().splitlines():
            line = re.sub(r"(\d)f\b", r"\1", line.strip().rstrip(";").replace("const T ", ""))
            line = line.replace("sh_const<T>(", "np.full_like(x0, ")
            exec(line, {"np": np}, env)
        got = np.stack([env["out"][i] for i in range(degree * degree)], 1)
        assert rel_err(got, spherical_harmonics(degree, x)) < 1e-6, degree


def nvcc_build(tmp_path, name, source, arch="sm_90"):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here: the generated CUDA source is only checked where it is")
    src = tmp_path / f"{name}.cu"
    src.write_text(source)
    done = subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-std=c++17", "-Xptxas", "-v", str(src), "-o",
                           str(tmp_path / f"{name}.cubin")], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict((k, int(a) + int(b)) for k, a, b in re.findall(
        r"Compiling entry function '(\w+)'.*?\n\s*(\d+) bytes stack frame, (\d+) bytes spill", done.stderr, flags=re.S))


def test_encoding_and_backward_sources_build_with_nvcc_without_spills(tmp_path):
    """Every parameter-free encoding's kernels and every grid's input gradient (the 'grids' and 'ngp'
    composites): built by nvcc for sm_90, no local memory; the mma training kernels compiled with
    the outside gradient as target (LOSS_GIVEN) use no more than those of a loss do."""
    all_free = MLPSpec.from_json({"n_input_dims": 12, "n_output_dims": 3, "network": NET, "encoding": {
        "otype": "Composite", "nested": [{"n_dims_to_encode": d, **ENCODINGS[e][1]} for e, d in
                                         (("identity", 2), ("frequency", 2), ("oneblob", 2), ("triangle", 3),
                                          ("spherical", 3))]}})
    report = nvcc_build(tmp_path, "enc", encoder_source(free_parts(all_free)))
    assert set(report) == {f"enc_{k}_{i}" for i in range(5) for k in ("forward", "backward")}
    assert all(v == 0 for v in report.values()), report
    for name in ("grids", "ngp"):
        plan = GridPlan(make_spec(name))
        report = nvcc_build(tmp_path, name, plan.source)
        assert set(report) == set(plan.kernels)
        assert all(v == 0 for v in report.values()), report

    class EncodedInput(MmaPlan):
        encoded_input = True

    plan = EncodedInput(make_spec("ngp"))
    given = nvcc_build(tmp_path, "given", plan._source("LOSS_GIVEN"))
    loss = nvcc_build(tmp_path, "loss", plan._source())
    kernels = ["mlp_train_fwd_bwd"] + (["mlp_train_fused"] if plan.fused_wgrad else [])
    assert given["mlp_train_fwd_bwd"] == 0 and all(given[k] <= loss[k] for k in kernels), (given, loss)


def test_free_parts_follow_the_encoding():
    spec = make_spec("grids")
    assert free_parts(spec) == (FreePart(0, spec.encoding.nested[1], 2, 1, 12, 8),)
    plan = GridPlan(spec)
    assert "grid_input_grad_0" in plan.kernels and "grid_input_grad_1" not in plan.kernels  # Nearest: none
