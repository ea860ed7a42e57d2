"""mmad.export and `mmad export`: ONNX in onnxruntime and the PyTorch module against the float64
oracle (the cpu backend's float64 mode) on fresh random inputs, the module training further in
PyTorch, and tiny-cuda-nn's flat parameter buffer built here from known matrices by tcnn's
layout (row-major fan_out × fan_in per layer, no biases, the encoding's output padded to 16
columns of 1, the output layer padded to 16 rows) giving the outputs of tcnn's math computed
here in float64. torch, onnx and onnxruntime are the optional extra mmad[export].
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from mmad import export
from mmad.backends import numerics as nm
from mmad.backends.cpu import CpuBackend
from mmad.cli import main as cli
from mmad.errors import InvalidInput
from mmad.spec import ACTIVATIONS, MLPSpec
from tests.oracle import rel_err

FP32_TOL = 1e-5  # docs/design.md: fp32 against float64

ENCODINGS = {
    "identity": {"otype": "Identity"},
    "scaled": {"otype": "Identity", "scale": 0.5, "offset": 0.25},
    "frequency": {"otype": "Frequency", "n_frequencies": 4},
    "oneblob": {"otype": "OneBlob", "n_bins": 16},
    "composite": {"otype": "Composite", "nested": [
        {"otype": "Frequency", "n_frequencies": 3, "n_dims_to_encode": 2},
        {"otype": "OneBlob", "n_bins": 8, "n_dims_to_encode": 1},
        {"otype": "Identity", "scale": 2.0, "offset": -1.0}]},
    "spherical": {"otype": "Composite", "nested": [
        {"otype": "SphericalHarmonics", "degree": 8, "n_dims_to_encode": 3}, {"otype": "Identity"}]},
    "triangle": {"otype": "TriangleWave", "n_frequencies": 6},
    # a small table, so that the finer levels hash and collide; 4 dims
    "hashgrid": {"otype": "HashGrid", "n_levels": 5, "n_features_per_level": 2, "log2_hashmap_size": 9,
                 "base_resolution": 4, "per_level_scale": 1.6},
    "grids": {"otype": "Composite", "nested": [
        {"otype": "DenseGrid", "n_levels": 3, "n_features_per_level": 4, "base_resolution": 3, "per_level_scale": 2.0,
         "interpolation": "Smoothstep", "n_dims_to_encode": 2},
        {"otype": "TiledGrid", "n_levels": 3, "n_features_per_level": 1, "base_resolution": 6, "per_level_scale": 1.5,
         "interpolation": "Nearest", "n_dims_to_encode": 2}]},
}
GRIDS = ("hashgrid", "grids")


def make_spec(encoding="identity", activation="ReLU", output_activation="None", n_in=4, n_out=3,
              width=32, layers=2, optimizer=None) -> MLPSpec:
    return MLPSpec.from_json({"n_input_dims": n_in, "n_output_dims": n_out, "precision": "fp32",
                              "network": {"otype": "FullyFusedMLP", "n_neurons": width, "n_hidden_layers": layers,
                                          "activation": activation, "output_activation": output_activation},
                              "encoding": ENCODINGS[encoding], "optimizer": optimizer or {"otype": "Adam"}})


def random_params(spec: MLPSpec, seed: int) -> dict[str, np.ndarray]:
    """Xavier-scaled weights and non-zero biases: fresh values, never the model's initial ones."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, (fan_in, fan_out) in enumerate(spec.layer_dims):
        out[f"W{i}"] = (rng.standard_normal((fan_out, fan_in)) * np.sqrt(2 / (fan_in + fan_out))).astype(np.float32)
        out[f"b{i}"] = (rng.standard_normal(fan_out) * 0.1).astype(np.float32)
    for name, shape in spec.grid_shapes.items():  # a grid's tables: random, not tcnn's near-zero start
        out[name] = rng.uniform(-1, 1, shape).astype(np.float32)
    return out


def inputs(spec: MLPSpec, rows: int, seed: int) -> np.ndarray:
    """Rows in [0, 1], a tenth of them in [−2, 3]: a grid's cells past its edges (negative,
    wrapping at 32 bits) and its hashing of large cells are exercised too."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (rows, spec.n_input_dims))
    wide = rng.random(rows) < 0.1
    x[wide] = rng.uniform(-2, 3, (int(wide.sum()), spec.n_input_dims))
    return x.astype(np.float32)


def oracle(spec: MLPSpec, params, x) -> np.ndarray:
    model = CpuBackend("float64").compile(spec)
    model.set_params(params)
    return model._forward_chunk(x, keep=False)[0]  # float64 outputs, not rounded to the API's fp32


# -- ONNX --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ort():
    pytest.importorskip("onnx", reason="onnx is not installed (pip install mmad[export])")
    return pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install mmad[export])")


def run_onnx(ort, data: bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return session.run(["OUTPUT"], {"INPUT": x})[0]


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_onnx_matches_oracle_per_encoding(ort, encoding):
    spec = make_spec(encoding, activation="Tanh")
    params = random_params(spec, 1)
    x = inputs(spec, 777, seed=2)
    out = run_onnx(ort, export.to_onnx(spec, params), x)
    assert out.dtype == np.float32 and out.shape == (777, 3)
    assert rel_err(out, oracle(spec, params, x)) <= FP32_TOL


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_onnx_matches_oracle_per_activation(ort, activation):
    output_activation = {"None": "Sigmoid", "Exponential": "None"}.get(activation, activation)
    spec = make_spec("frequency", activation=activation, output_activation=output_activation)
    params = random_params(spec, 3)
    x = inputs(spec, 500, seed=4)
    assert rel_err(run_onnx(ort, export.to_onnx(spec, params), x), oracle(spec, params, x)) <= FP32_TOL


def test_trained_store_version_exports_to_onnx_through_the_cli(ort, tmp_path, capsys):
    """A model trained by mmad, its version written as the store writes it (model.json + weights
    safetensors), exported with `mmad export`, runs in onnxruntime like the oracle."""
    spec = make_spec("composite", activation="SiLU")
    model = CpuBackend("fp32").compile(spec)
    x = inputs(spec, 256, seed=5)
    y = np.sin(3 * x[:, :3]).astype(np.float32)
    losses = model.train_step(x, y, steps=30)
    assert losses[-1] < losses[0]
    (tmp_path / "model.json").write_text(json.dumps({"spec": spec.to_json(), "config": {}}))
    save_file(model.get_params(), str(tmp_path / "1.safetensors"))
    assert cli(["export", "--config", str(tmp_path / "model.json"), "--params", str(tmp_path / "1.safetensors"),
                "--to", "onnx", "-o", str(tmp_path / "m.onnx")]) == 0
    assert "m.onnx (onnx" in capsys.readouterr().out
    fresh = inputs(spec, 1000, seed=6)
    out = run_onnx(ort, (tmp_path / "m.onnx").read_bytes(), fresh)
    assert rel_err(out, oracle(spec, model.get_params(), fresh)) <= FP32_TOL


def test_ema_model_exports_its_averaged_weights(ort, tmp_path):
    spec = make_spec(optimizer={"otype": "EMA", "decay": 0.9, "nested": {"otype": "Adam", "learning_rate": 1e-2}})
    model = CpuBackend("fp32").compile(spec)
    x = inputs(spec, 128, seed=7)
    model.train_step(x, np.cos(x[:, :3]), steps=20)
    save_file(model.get_params(), str(tmp_path / "w.safetensors"))
    save_file(model.get_optimizer_state(), str(tmp_path / "o.safetensors"))
    (tmp_path / "c.json").write_text(json.dumps(spec.to_json()))
    args = ["export", "--config", str(tmp_path / "c.json"), "--params", str(tmp_path / "w.safetensors"),
            "--to", "onnx", "-o", str(tmp_path / "m.onnx")]
    assert cli(args) == 2  # without the optimizer state the averaged weights are unknown
    assert cli(args + ["--optimizer-state", str(tmp_path / "o.safetensors")]) == 0
    fresh = inputs(spec, 300, seed=8)
    # what the model serves: its forward, which infers with the EMA average
    assert rel_err(run_onnx(ort, (tmp_path / "m.onnx").read_bytes(), fresh), model.forward(fresh)) <= FP32_TOL


# -- PyTorch -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch", reason="torch is not installed (pip install mmad[export])")


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_torch_module_matches_oracle(torch, encoding):
    spec = make_spec(encoding, activation="Softplus", output_activation="Squareplus")
    params = random_params(spec, 9)
    x = inputs(spec, 600, seed=10)
    ref = oracle(spec, params, x)
    module = export.to_torch(spec, params)
    with torch.no_grad():
        assert rel_err(module(torch.from_numpy(x)).numpy(), ref) <= FP32_TOL
        # in float64 the module computes the oracle's very operations
        assert rel_err(module.double()(torch.from_numpy(x).double()).numpy(), ref) <= 1e-12


def test_torch_module_trains_further_and_comes_back(torch, tmp_path):
    spec = make_spec("oneblob", activation="ReLU")
    model = CpuBackend("fp32").compile(spec)
    x = inputs(spec, 512, seed=11)
    y = np.stack([x[:, 0] * x[:, 1], np.sin(4 * x[:, 2]), x[:, 3] ** 2], axis=1).astype(np.float32)
    model.train_step(x, y, steps=10)
    module = export.to_torch(spec, model.get_params())
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = torch.mean((module(xt) - yt) ** 2)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    # the further-trained weights come back into mmad through the state dict
    torch.save(module.state_dict(), tmp_path / "sd.pt")
    (tmp_path / "c.json").write_text(json.dumps(spec.to_json()))
    assert cli(["export", "--config", str(tmp_path / "c.json"), "--state-dict", str(tmp_path / "sd.pt"),
                "--to", "safetensors", "-o", str(tmp_path / "w.safetensors")]) == 0
    from safetensors.numpy import load_file

    model.set_params(load_file(str(tmp_path / "w.safetensors")))
    fresh = inputs(spec, 200, seed=12)
    with torch.no_grad():
        assert rel_err(model.forward(fresh), module(torch.from_numpy(fresh)).numpy()) <= FP32_TOL


def test_plain_sequential_state_dict_imports(torch):
    torch.manual_seed(0)
    for bias in (True, False):
        seq = torch.nn.Sequential(torch.nn.Linear(4, 32, bias=bias), torch.nn.Tanh(), torch.nn.Linear(32, 32, bias=bias),
                                  torch.nn.Tanh(), torch.nn.Linear(32, 3, bias=bias))
        spec = make_spec(activation="Tanh")
        params = export.from_state_dict(spec, seq.state_dict())
        x = inputs(spec, 300, seed=13)
        with torch.no_grad():
            expected = seq.double()(torch.from_numpy(x).double()).numpy()
        assert rel_err(oracle(spec, params, x), expected) <= 1e-12
    with pytest.raises(InvalidInput, match=r"0.weight must be Linear\(5, 32\)'s weight of shape \[32, 5\]"):
        export.from_state_dict(make_spec(n_in=5), seq.state_dict())
    with pytest.raises(InvalidInput, match="unexpected entries"):
        export.from_state_dict(spec, {**seq.state_dict(), "5.running_mean": torch.zeros(3)})
    with pytest.raises(InvalidInput, match="3 Linear layers; the state dict holds 2"):
        export.from_state_dict(spec, {k: v for k, v in seq.state_dict().items() if not k.startswith("4.")})


# -- tiny-cuda-nn parameters ---------------------------------------------------------------------
def pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def tcnn_buffer(spec: MLPSpec, seed: int):
    """Known matrices in tcnn's order and shapes, and their flat buffer (each row-major)."""
    rng = np.random.default_rng(seed)
    shapes = ([(spec.n_neurons, pad16(spec.n_encoded_dims))] + [(spec.n_neurons, spec.n_neurons)] * (spec.n_hidden_layers - 1)
              + [(pad16(spec.n_output_dims), spec.n_neurons)])
    mats = [rng.standard_normal(s) / np.sqrt(s[1]) for s in shapes]
    return mats, np.concatenate([m.reshape(-1) for m in mats])


def tcnn_forward(spec: MLPSpec, mats, x: np.ndarray, tables=(), pad: float = 1.0) -> np.ndarray:
    """tcnn's network in float64: the encoding (a grid's ``tables``) padded with ``pad``, bias-free
    layers, output rows cut."""
    h = nm.encode(spec.encoding, x.astype(np.float64), tables)
    h = np.concatenate([h, np.full((len(h), mats[0].shape[1] - h.shape[1]), pad)], axis=1)
    for i, m in enumerate(mats):
        last = i == len(mats) - 1
        h = nm.activate(spec.output_activation if last else spec.activation, h @ m.T)
    return h[:, :spec.n_output_dims]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("encoding,n_out,layers", [("identity", 3, 2), ("frequency", 1, 3), ("composite", 16, 1),
                                                   ("oneblob", 5, 2)])
def test_tcnn_buffer_loads_and_gives_its_outputs(dtype, encoding, n_out, layers):
    spec = make_spec(encoding, activation="ReLU", output_activation="Sigmoid", n_out=n_out, layers=layers)
    mats, flat = tcnn_buffer(spec, seed=14)
    flat = flat.astype(dtype)
    mats = [m.astype(dtype).astype(np.float64) for m in mats]  # the values the buffer holds
    assert flat.size == export.tcnn_n_params(spec)
    params = export.from_tcnn(spec, flat)
    x = inputs(spec, 400, seed=15)
    assert rel_err(oracle(spec, params, x), tcnn_forward(spec, mats, x)) <= FP32_TOL
    # raw bytes as tcnn writes them, through the CLI, give the same parameters
    raw = export.from_tcnn(spec, flat.tobytes(), "fp16" if dtype == np.float16 else "fp32")
    assert all(np.array_equal(raw[k], params[k]) for k in params)


def test_tcnn_padding_columns_become_the_first_bias():
    spec = make_spec("identity", n_in=4)  # 4 inputs pad to 16: 12 columns of ones
    mats, flat = tcnn_buffer(spec, seed=16)
    params = export.from_tcnn(spec, flat)
    np.testing.assert_allclose(params["b0"], mats[0][:, 4:].sum(axis=1), rtol=1e-6)
    assert not params["b1"].any() and not params["b2"].any()
    np.testing.assert_array_equal(params["W2"], mats[2][:3].astype(np.float32))  # the first n_output_dims rows


def test_tcnn_buffer_of_the_wrong_size_says_the_layout():
    spec = make_spec("frequency", n_in=4)  # 32 encoded dims: no padding; 3 outputs pad to 16
    with pytest.raises(InvalidInput, match=r"holds 2560 parameters \(32x32 \+ 32x32 \+ 16x32"):
        export.from_tcnn(spec, np.zeros(2559, np.float16))
    with pytest.raises(InvalidInput, match="need their dtype"):
        export.from_tcnn(spec, b"\0" * 10)


def test_cli_imports_a_tcnn_file(tmp_path, capsys):
    spec = make_spec("composite", n_out=2)
    mats, flat = tcnn_buffer(spec, seed=17)
    (tmp_path / "params.bin").write_bytes(flat.astype(np.float16).tobytes())
    (tmp_path / "config.json").write_text(json.dumps(spec.to_json()))
    out = tmp_path / "w.safetensors"
    assert cli(["export", "--config", str(tmp_path / "config.json"), "--tcnn-params", str(tmp_path / "params.bin"),
                "--to", "safetensors", "-o", str(out)]) == 0
    from safetensors.numpy import load_file

    x = inputs(spec, 100, seed=18)
    expected = tcnn_forward(spec, [m.astype(np.float16).astype(np.float64) for m in mats], x)
    assert rel_err(oracle(spec, load_file(str(out)), x), expected) <= FP32_TOL
    # a buffer of the wrong dtype is the wrong size: one line, exit 2
    assert cli(["export", "--config", str(tmp_path / "config.json"), "--tcnn-params", str(tmp_path / "params.bin"),
                "--tcnn-dtype", "fp32", "--to", "safetensors", "-o", str(out)]) == 2
    assert "tiny-cuda-nn's buffer for this config holds" in capsys.readouterr().err


NGP = {"otype": "Composite", "nested": [
    {"otype": "HashGrid", "n_levels": 6, "n_features_per_level": 2, "log2_hashmap_size": 10, "base_resolution": 8,
     "per_level_scale": 1.5, "n_dims_to_encode": 3},
    {"otype": "SphericalHarmonics", "degree": 4}]}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("encoding", ["hashgrid", "grids", "ngp"])
def test_tcnn_buffer_of_a_grid_model_loads_its_tables(dtype, encoding):
    """tcnn's buffer of a grid model: the network's matrices, then every grid part's table (levels
    back to back, a row's features adjacent); a grid pads the encoded input with 0 (hashgrid: 10
    columns to 16, grids: the TiledGrid's 3 to 16), other encodings with 1 (ngp: SphericalHarmonics
    last)."""
    if encoding == "ngp":
        spec = MLPSpec.from_json({"n_input_dims": 6, "n_output_dims": 3, "precision": "fp32", "encoding": NGP,
                                  "network": {"otype": "FullyFusedMLP", "n_neurons": 32, "n_hidden_layers": 2}})
    else:
        spec = make_spec(encoding)
    mats, flat = tcnn_buffer(spec, seed=24)
    rng = np.random.default_rng(25)
    tables = [rng.uniform(-1, 1, shape) for shape in spec.grid_shapes.values()]
    flat = np.concatenate([flat] + [t.reshape(-1) for t in tables]).astype(dtype)
    mats = [m.astype(dtype).astype(np.float64) for m in mats]
    tables = [t.astype(dtype).astype(np.float64) for t in tables]
    assert flat.size == export.tcnn_n_params(spec)
    params = export.from_tcnn(spec, flat)
    x = inputs(spec, 500, seed=26)
    pad = 1.0 if encoding == "ngp" else 0.0
    assert rel_err(oracle(spec, params, x), tcnn_forward(spec, mats, x, tables, pad)) <= FP32_TOL


def test_tcnn_buffer_with_padding_between_a_composites_parts_is_refused():
    spec = MLPSpec.from_json({"n_input_dims": 3, "n_output_dims": 3, "network": {"n_neurons": 32, "n_hidden_layers": 1},
                              "encoding": {"otype": "Composite", "nested": [
                                  {"otype": "Identity", "n_dims_to_encode": 1},
                                  {"otype": "HashGrid", "n_levels": 2, "n_features_per_level": 2,
                                   "log2_hashmap_size": 8}]}})
    with pytest.raises(InvalidInput, match="pads the encoded input before the HashGrid part"):
        export.from_tcnn(spec, np.zeros(export.tcnn_n_params(spec), np.float32))


def test_instant_ngp_style_model_exports_and_its_tables_train_further(ort, torch, tmp_path):
    """tcnn's instant-NGP composite (a 3-D hash grid of the position, SphericalHarmonics of the
    direction): ONNX and the module match the oracle; the module's tables are parameters that
    PyTorch trains, and they come back into mmad through the state dict."""
    spec = MLPSpec.from_json({
        "n_input_dims": 6, "n_output_dims": 3, "precision": "fp32",
        "network": {"otype": "FullyFusedMLP", "n_neurons": 32, "n_hidden_layers": 2, "activation": "ReLU",
                    "output_activation": "None"},
        "encoding": {"otype": "Composite", "nested": [
            {"otype": "HashGrid", "n_levels": 6, "n_features_per_level": 2, "log2_hashmap_size": 10,
             "base_resolution": 8, "per_level_scale": 1.5, "n_dims_to_encode": 3},
            {"otype": "SphericalHarmonics", "degree": 4}]}})
    params = random_params(spec, 21)
    x = inputs(spec, 700, seed=22)
    ref = oracle(spec, params, x)
    assert rel_err(run_onnx(ort, export.to_onnx(spec, params), x), ref) <= FP32_TOL
    module = export.to_torch(spec, params)
    with torch.no_grad():
        assert rel_err(module(torch.from_numpy(x)).numpy(), ref) <= FP32_TOL
    y = torch.from_numpy(np.sin(3 * x[:, :3]).astype(np.float32))
    before = module.grids[0].detach().clone()
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = torch.mean((module(torch.from_numpy(x)) - y) ** 2)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert not torch.equal(before, module.grids[0].detach())  # the table trained
    back = export.from_state_dict(spec, module.state_dict())
    fresh = inputs(spec, 300, seed=23)
    with torch.no_grad():
        assert rel_err(oracle(spec, back, fresh), module.double()(torch.from_numpy(fresh).double()).numpy()) <= 1e-12
    with pytest.raises(InvalidInput, match=r"lacks \['grids.0'\]"):
        export.from_state_dict(spec, {k: v for k, v in module.state_dict().items() if k != "grids.0"})
