"""tiny-cuda-nn's optimizer wrappers ``ExponentialDecay`` and ``EMA`` (optimizers/exponential_decay.h,
ema.h): their JSON fields and defaults, the learning-rate schedule against a transcription of
tcnn's stateful loop, the cpu backend's training against a float64 loop written here from
``loss_and_grads``, and the vulkan (lavapipe) and wgpu backends against the cpu oracle: loss
curves under ExponentialDecay; under EMA the losses, raw weights, averages and served outputs,
the averages against the cpu reference's update replayed on the device's own weights, and a
checkpoint round trip. The ``check_ema_*`` helpers take a compile function, so
tests/test_cuda_ema.py runs the same checks on the cuda mma variant.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mmad.backends import numerics as nm
from mmad.backends.contract import CompiledModel, optimizer_state_names
from mmad.backends.cpu import CpuBackend, CpuModel
from mmad.errors import SpecError
from mmad.spec import EmaSpec, ExponentialDecaySpec, MLPSpec, OptimizerSpec, bench_spec

ADAM = {"otype": "Adam", "learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-15}
DECAY = {"decay_base": 0.5, "decay_start": 4, "decay_interval": 5, "decay_end": 20}


def small_spec(optimizer: dict, precision: str = "fp32") -> MLPSpec:
    return MLPSpec.from_json({"n_input_dims": 5, "n_output_dims": 3, "precision": precision,
                              "network": {"n_neurons": 16, "n_hidden_layers": 2, "activation": "Tanh"},
                              "optimizer": optimizer})


def task(spec: MLPSpec, rows: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (rows, spec.n_input_dims)).astype(np.float32)
    y = np.sin(2 * x @ rng.standard_normal((spec.n_input_dims, spec.n_output_dims))).astype(np.float32)
    return x, y


# -- JSON ------------------------------------------------------------------------------------
def test_wrapper_defaults_are_tcnns():
    opt = OptimizerSpec.parse("optimizer", {"otype": "ExponentialDecay"})
    # tcnn: nested defaults to {} (an Adam with its defaults); decay 0.1 every 10000 from 10000 to 1e7
    assert opt.otype == "Adam" and opt.learning_rate == 1e-3
    assert opt.decay == ExponentialDecaySpec(0.1, 10000, 10000, 10000000) and opt.ema is None
    opt = OptimizerSpec.parse("optimizer", {"otype": "EMA", "nested": {"otype": "SGD", "learning_rate": 0.1}})
    assert (opt.otype, opt.learning_rate, opt.ema, opt.decay) == ("SGD", 0.1, EmaSpec(0.99, False), None)


def test_nesting_orders_parse_alike_and_round_trip():
    ema_outside = {"otype": "EMA", "decay": 0.95, "full_precision": True,
                   "nested": {"otype": "ExponentialDecay", **DECAY, "nested": ADAM}}
    decay_outside = {"otype": "ExponentialDecay", **DECAY,
                     "nested": {"otype": "ema", "decay": 0.95, "full_precision": True, "nested": ADAM}}
    a, b = small_spec(ema_outside), small_spec(decay_outside)
    assert a == b and a.content_hash() == b.content_hash()
    assert a.optimizer.to_json() == ema_outside | {"nested": ema_outside["nested"] | {
        "nested": ADAM | {"l2_reg": 0.0}}}
    assert MLPSpec.from_json(a.to_json()) == a
    # a plain Adam spec writes what it always wrote (stored models keep their content hash)
    assert small_spec(ADAM).to_json()["optimizer"] == ADAM | {"l2_reg": 0.0}


@pytest.mark.parametrize("doc,field,words", [
    ({"otype": "ExponentialDecay", "decay_interval": 0}, "optimizer.decay_interval", "from 1"),
    ({"otype": "ExponentialDecay", "decay_base": 0}, "optimizer.decay_base", "(0.0, 1.0]"),
    ({"otype": "ExponentialDecay", "learning_rate": 0.1}, "optimizer.learning_rate", "unknown field"),
    ({"otype": "ExponentialDecay", "nested": {"otype": "ExponentialDecay"}}, "optimizer.nested", "at most one"),
    ({"otype": "EMA", "decay": 1.0}, "optimizer.decay", "must be in"),
    ({"otype": "EMA", "full_precision": 1}, "optimizer.full_precision", "true or false"),
    ({"otype": "EMA", "nested": {"otype": "EMA"}}, "optimizer.nested", "at most one"),
    ({"otype": "EMA", "nested": {"otype": "Shampoo"}}, "optimizer.nested.otype", "ExponentialDecay, EMA"),
    ({"otype": "EMA", "nested": {"otype": "SGD", "beta1": 0.9}}, "optimizer.nested.beta1", "unknown field"),
])
def test_wrapper_errors_name_the_field(doc, field, words):
    with pytest.raises(SpecError) as err:
        small_spec(doc)
    assert err.value.field == field and words in str(err.value)


# -- the schedule ----------------------------------------------------------------------------
def tcnn_rates(opt: OptimizerSpec, steps: int) -> list[float]:
    """ExponentialDecayOptimizer::step transcribed: the factor is state, multiplied by decay_base
    before a step when the nested optimizer's completed-step count is on the schedule; Adam then
    applies its bias correction at its (already incremented) step."""
    d, factor, rates = opt.decay, 1.0, []
    for completed in range(steps):
        if completed >= d.decay_start and (completed - d.decay_start) % d.decay_interval == 0 \
                and completed <= d.decay_end:
            factor *= d.decay_base
        lr, t = opt.learning_rate * factor, completed + 1
        if opt.otype == "Adam":
            lr *= np.sqrt(1 - opt.beta2 ** t) / (1 - opt.beta1 ** t)
        rates.append(lr)
    return rates


@pytest.mark.parametrize("decay", [DECAY, {"decay_base": 0.9, "decay_start": 0, "decay_interval": 1, "decay_end": 7},
                                   {"decay_base": 0.3, "decay_start": 10, "decay_interval": 2, "decay_end": 5},
                                   {}])
@pytest.mark.parametrize("inner", [ADAM, {"otype": "SGD", "learning_rate": 0.3, "momentum": 0.5}])
def test_step_rates_follow_tcnns_loop(decay, inner):
    opt = OptimizerSpec.parse("optimizer", {"otype": "ExponentialDecay", **decay, "nested": inner})
    steps = 40
    ref = tcnn_rates(opt, steps)
    ours = [nm.step_learning_rate(opt, t) for t in range(1, steps + 1)]
    np.testing.assert_allclose(ours, ref, rtol=1e-12)
    model = CpuBackend("float64").compile(small_spec({"otype": "ExponentialDecay", **decay, "nested": inner}))
    np.testing.assert_allclose(model.step_rates(steps), ref, rtol=1e-6)  # the table device loops read (fp32)


# -- cpu: training against a float64 loop written here -----------------------------------------
def reference_training(spec: MLPSpec, x, y, steps: int):
    """(losses, raw weights, EMA weights) of ``steps`` steps of tcnn's Adam/SGD with the decayed
    rate and the debiased EMA, in float64; gradients from the float64 oracle at each step's weights."""
    opt = spec.optimizer
    plain = spec.replace(optimizer=OptimizerSpec(opt.otype, opt.learning_rate, opt.beta1, opt.beta2,
                                                 opt.epsilon, opt.l2_reg, opt.momentum))
    grad_model = CpuBackend("float64").compile(plain)
    w = {k: v.astype(np.float64) for k, v in grad_model.get_params().items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v2 = {k: np.zeros_like(v) for k, v in w.items()}
    ema = {k: np.zeros_like(v) for k, v in w.items()}
    losses = []
    for t in range(1, steps + 1):
        grad_model.set_params(w)
        loss, grads = grad_model.loss_and_grads(x, y)
        losses.append(loss)
        lr = tcnn_rates(opt, t)[-1]
        for k in w:
            g = grads[k] + opt.l2_reg * w[k]
            if opt.otype == "Adam":
                m[k] = opt.beta1 * m[k] + (1 - opt.beta1) * g
                v2[k] = opt.beta2 * v2[k] + (1 - opt.beta2) * g * g
                w[k] = w[k] - lr * m[k] / (np.sqrt(v2[k]) + opt.epsilon)
            else:
                m[k] = opt.momentum * m[k] + g
                w[k] = w[k] - lr * m[k]
            if opt.ema is not None:
                d = opt.ema.decay
                ema[k] = (ema[k] * d * (1 - d ** (t - 1)) + w[k] * (1 - d)) / (1 - d ** t)
    return np.array(losses), w, ema


@pytest.mark.parametrize("inner", [ADAM, {"otype": "SGD", "learning_rate": 0.2, "momentum": 0.9, "l2_reg": 1e-3}])
def test_cpu_exponential_decay_trains_as_tcnn(inner):
    spec = small_spec({"otype": "ExponentialDecay", **DECAY, "nested": inner})
    x, y = task(spec, 200)
    ref_losses, ref_w, _ = reference_training(spec, x, y, 30)
    model = CpuBackend("float64").compile(spec)
    losses = model.train_step(x, y, steps=30)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)  # fp32 loss values of a float64 run
    for k, v in model.get_params().items():
        np.testing.assert_allclose(v, ref_w[k], rtol=1e-5, atol=1e-6)
    # the schedule matters here: without it the run ends elsewhere
    undecayed = CpuBackend("float64").compile(small_spec(inner)).train_step(x, y, steps=30)
    assert abs(undecayed[-1] / losses[-1] - 1) > 0.02


@pytest.mark.parametrize("full_precision", [False, True])
def test_cpu_ema_serves_the_average_and_trains_the_raw_weights(full_precision):
    ema_doc = {"otype": "EMA", "decay": 0.8, "full_precision": full_precision,
               "nested": {"otype": "ExponentialDecay", **DECAY, "nested": ADAM}}
    spec = small_spec(ema_doc)
    x, y = task(spec, 150)
    model = CpuBackend("float64").compile(spec)
    x_new = np.random.default_rng(9).uniform(-1, 1, (64, 5)).astype(np.float32)
    before = CpuBackend("float64").compile(small_spec(ADAM)).forward(x_new)
    np.testing.assert_array_equal(model.forward(x_new), before)  # before a step: the initial weights
    ref_losses, ref_w, ref_ema = reference_training(spec, x, y, 25)
    losses = model.train_step(x, y, steps=25)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)  # the average never feeds back into training
    state = model.get_optimizer_state()
    assert sorted(state) == sorted(optimizer_state_names(spec) + ["step"])
    assert {n for n in state if n.startswith("ema.")} == {f"ema.{k}" for k in ref_ema}
    plain = CpuBackend("float64").compile(small_spec(ADAM))
    for kind, weights in (("ema", ref_ema), ("raw", ref_w)):
        plain.set_params(weights)
        expected = plain.forward(x_new)
        got = model.forward(x_new)
        if kind == "ema":
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        else:  # the average is far enough from the raw weights that serving them would show
            assert np.abs(got - expected).max() > 1e-3


def test_ema_keeps_fp16_averages_without_full_precision():
    for full_precision, representable in ((False, True), (True, False)):
        spec = small_spec({"otype": "EMA", "decay": 0.9, "full_precision": full_precision, "nested": ADAM}, "fp16")
        model = CpuBackend("emulate").compile(spec)
        model.train_step(*task(spec, 100), steps=5)
        w = model.get_optimizer_state()["ema.W1"]
        assert np.array_equal(w.astype(np.float16).astype(np.float32), w) == representable


def test_ema_checkpoint_resumes_exactly(tmp_path):
    spec = small_spec({"otype": "EMA", "decay": 0.9, "nested": {"otype": "ExponentialDecay", **DECAY, "nested": ADAM}})
    x, y = task(spec, 120)
    x_new = task(spec, 40, seed=11)[0]
    a = CpuBackend("fp32").compile(spec)
    a.train_step(x, y, steps=12)
    save_file(a.get_params(), str(tmp_path / "params.safetensors"))
    save_file(a.get_optimizer_state(), str(tmp_path / "state.safetensors"))
    served = a.forward(x_new)
    b = CpuBackend("fp32").compile(spec)
    b.set_params(load_file(str(tmp_path / "params.safetensors")))  # the registry's order: params, then state
    b.set_optimizer_state(load_file(str(tmp_path / "state.safetensors")))
    np.testing.assert_array_equal(b.forward(x_new), served)
    np.testing.assert_array_equal(b.train_step(x, y, steps=9), a.train_step(x, y, steps=9))
    np.testing.assert_array_equal(b.forward(x_new), a.forward(x_new))


def test_set_params_on_an_ema_model_serves_them():
    spec = small_spec({"otype": "EMA", "nested": ADAM})
    model = CpuBackend("float64").compile(spec)
    model.train_step(*task(spec, 50), steps=4)
    new = {k: np.random.default_rng(5).standard_normal(v.shape).astype(np.float32) for k, v in model.get_params().items()}
    model.set_params(new)
    plain = CpuBackend("float64").compile(small_spec(ADAM))
    plain.set_params(new)
    x_new = task(spec, 30, seed=8)[0]
    np.testing.assert_array_equal(model.forward(x_new), plain.forward(x_new))


# -- device backends: the rate comes from the contract's schedule -------------------------------
def _vulkan_backend(variant: str = "simt"):
    vulkan = pytest.importorskip("mmad.backends.vulkan", reason="the vulkan Python package is not installed")
    backend = vulkan.VulkanBackend()
    row = {r.variant: r for r in backend.probe()}[variant]
    if not row.available:
        backend.close()
        pytest.skip(f"the vulkan {variant} variant is unavailable here: {row.reason}")
    return backend, variant


def _wgpu_backend():
    pytest.importorskip("wgpu", reason="wgpu-py is not installed")
    from mmad.backends.webgpu import WgpuBackend

    backend = WgpuBackend()
    row = backend.probe()[0]
    if not row.available:
        pytest.skip(f"no WebGPU adapter: {row.reason}")
    return backend, None


DEVICE_BACKENDS = [pytest.param(_vulkan_backend, marks=pytest.mark.vulkan, id="vulkan"),
                   pytest.param(lambda: _vulkan_backend("coopmat"), marks=pytest.mark.vulkan, id="vulkan-coopmat"),
                   pytest.param(lambda: _vulkan_backend("coopmat2"), marks=pytest.mark.vulkan, id="vulkan-coopmat2"),
                   pytest.param(_wgpu_backend, marks=pytest.mark.wgpu, id="wgpu")]


@pytest.fixture(scope="module", params=DEVICE_BACKENDS)
def device(request):
    backend, variant = request.param()
    yield backend, variant
    backend.close()


# an SGD run whose rate drops tenfold after step 10 and again after 20: the curve bends visibly
DEVICE_DECAY = {"otype": "ExponentialDecay", "decay_base": 0.1, "decay_start": 10, "decay_interval": 10,
                "nested": {"otype": "SGD", "learning_rate": 0.5, "momentum": 0.9}}


@pytest.mark.parametrize("inner", [DEVICE_DECAY["nested"], ADAM | {"learning_rate": 3e-2}])
def test_device_exponential_decay_follows_oracle(device, inner):
    backend, variant = device
    spec = bench_spec("S", optimizer=DEVICE_DECAY | {"nested": inner})
    x, y = task(spec, 256, seed=7)
    ref = CpuBackend("float64").compile(spec).train_step(x, y, steps=40)
    undecayed = CpuBackend("float64").compile(bench_spec("S", optimizer=inner)).train_step(x, y, steps=40)
    with backend.compile(spec, variant) as model:
        losses = model.train_step(x, y, steps=40)
        assert model.get_optimizer_state()["step"][0] == 40
    # docs/design.md: an fp16 loss curve follows the oracle's within 5 % at every step
    assert np.all(np.abs(losses - ref) <= 0.05 * ref), np.max(np.abs(losses / ref - 1))
    # and the undecayed curve is out of that band: the device did apply the schedule
    assert np.max(np.abs(losses / undecayed - 1)) > 0.1, np.max(np.abs(losses / undecayed - 1))


EMA_SGD = {"otype": "EMA", "decay": 0.9, "nested": DEVICE_DECAY["nested"] | {"learning_rate": 0.3}}
EMA_ADAM = {"otype": "EMA", "decay": 0.9, "nested": ADAM | {"learning_rate": 3e-2}}


def _device_compile(device) -> Callable[[MLPSpec], CompiledModel]:
    backend, variant = device
    return lambda spec: backend.compile(spec, variant)


@pytest.mark.parametrize("ema_doc", [EMA_SGD, EMA_ADAM], ids=["sgd", "adam"])
def test_device_ema_follows_float64_oracle(device, ema_doc):
    # fp32: nothing rounds, so the device follows the float64 oracle to fp32 accuracy
    if device[1] in ("coopmat", "coopmat2"):
        pytest.skip(f"precision fp32 runs no MMA; the {device[1]} variant is fp16 only")
    spec = bench_spec("S", precision="fp32", optimizer=ema_doc)
    x, y = task(spec, 256, seed=7)
    x_new = task(spec, 100, seed=17)[0]
    oracle = CpuBackend("float64").compile(spec)
    with _device_compile(device)(spec) as model:
        np.testing.assert_allclose(model.forward(x_new), oracle.forward(x_new), atol=1e-5)  # the initial weights
        ref_losses = oracle.train_step(x, y, steps=20)
        np.testing.assert_allclose(model.train_step(x, y, steps=20), ref_losses, rtol=1e-4)
        state, ref_state = model.get_optimizer_state(), oracle.get_optimizer_state()
        assert sorted(state) == sorted(ref_state)
        for name, value in model.get_params().items():
            np.testing.assert_allclose(value, oracle.get_params()[name], atol=1e-5, err_msg=name)
            np.testing.assert_allclose(state[f"ema.{name}"], ref_state[f"ema.{name}"], atol=1e-5, err_msg=name)
        served = model.forward(x_new)
        np.testing.assert_allclose(served, oracle.forward(x_new), atol=1e-5)
        raw = CpuBackend("float64").compile(bench_spec("S", precision="fp32"))
        raw.set_params(model.get_params())
        assert np.abs(served - raw.forward(x_new)).max() > 1e-3  # it serves the average, not the raw weights


def check_ema_tracks_its_own_weights(compile_model: Callable[[MLPSpec], CompiledModel], spec: MLPSpec,
                                     steps: int = 8) -> None:
    """An fp16 EMA model's averages are the cpu reference's update (numerics.ema_update, fp32)
    replayed on the weights the model itself reached after each step (its raw weights diverge
    from an fp16 oracle's under Adam, the update rule must not); one submission of ``steps``
    steps ends where ``steps`` single steps do; inference serves the averages exactly as a
    plain model given them as its weights; the loss curve follows the emulating oracle."""
    ema, precision = spec.optimizer.ema, spec.precision
    x, y = task(spec, 256, seed=5)
    x_new = task(spec, 100, seed=15)[0]
    with compile_model(spec) as stepped, compile_model(spec) as batched, \
            compile_model(spec.replace(optimizer=spec.optimizer.to_json()["nested"])) as plain:
        average = {k: v.copy() for k, v in stepped.get_params().items()}
        losses = []
        for t in range(1, steps + 1):
            losses.append(stepped.train_step(x, y)[0])
            for name, w in stepped.get_params().items():
                rounding = precision if name.startswith("W") else "fp32"
                nm.ema_update(ema, t, nm.round_to(rounding, w), average[name])
                if not ema.full_precision:
                    average[name][...] = nm.round_to(rounding, average[name])
        state = stepped.get_optimizer_state()
        for name, value in average.items():
            got = state[f"ema.{name}"]
            # a fused multiply-add may land an average on the neighbouring fp16 value
            np.testing.assert_allclose(got, value, rtol=1e-5 if ema.full_precision else 2e-3, atol=1e-6, err_msg=name)
            if not ema.full_precision and name.startswith("W"):  # biases are averaged in fp32 (cpu.py)
                np.testing.assert_array_equal(got.astype(np.float16).astype(np.float32), got, err_msg=name)
        assert not np.allclose(state["ema.W1"], stepped.get_params()["W1"], atol=1e-3)
        np.testing.assert_array_equal(batched.train_step(x, y, steps=steps), np.array(losses, np.float32))
        for name, value in batched.get_optimizer_state().items():
            np.testing.assert_array_equal(value, state[name], err_msg=name)
        ref = CpuBackend("emulate").compile(spec).train_step(x, y, steps=steps)
        assert np.all(np.abs(np.array(losses) - ref) <= 0.05 * ref), np.max(np.abs(np.array(losses) / ref - 1))
        plain.set_params({name: state[f"ema.{name}"] for name in average})
        np.testing.assert_array_equal(stepped.forward(x_new), plain.forward(x_new))


def check_ema_checkpoint_resumes(compile_model: Callable[[MLPSpec], CompiledModel], spec: MLPSpec) -> None:
    """get_params / get_optimizer_state of a trained EMA model, set on a fresh one in the
    registry's order (parameters, then state): the same served outputs and the same next
    losses; then set_params alone serves the weights set, as on cpu."""
    x, y = task(spec, 200, seed=21)
    x_new = task(spec, 64, seed=22)[0]
    with compile_model(spec) as a, compile_model(spec) as b:
        a.train_step(x, y, steps=6)
        b.set_params(a.get_params())
        b.set_optimizer_state(a.get_optimizer_state())
        np.testing.assert_array_equal(b.forward(x_new), a.forward(x_new))
        np.testing.assert_array_equal(b.train_step(x, y, steps=5), a.train_step(x, y, steps=5))
        np.testing.assert_array_equal(b.forward(x_new), a.forward(x_new))
        new = {k: np.random.default_rng(5).standard_normal(v.shape).astype(np.float32) * 0.3
               for k, v in a.get_params().items()}
        b.set_params(new)
        a.set_optimizer_state(b.get_optimizer_state() | {f"ema.{k}": v for k, v in new.items()})
        served = b.forward(x_new)
        np.testing.assert_array_equal(a.forward(x_new), served)  # the restored average is what a serves
        plain = CpuBackend("emulate").compile(spec.replace(optimizer=spec.optimizer.to_json()["nested"]))
        plain.set_params(new)
        # the served outputs are a plain model's with those weights: fp16 rounding apart (one
        # flipped ReLU moves an element by more than a per-element bound, so the norm is judged)
        ref = plain.forward(x_new)
        assert np.linalg.norm(served - ref) / np.linalg.norm(ref) < 1e-2


def test_the_cpu_reference_passes_the_device_checks():
    emulate = CpuBackend("emulate").compile
    check_ema_tracks_its_own_weights(emulate, bench_spec("S", optimizer=EMA_SGD))
    check_ema_checkpoint_resumes(emulate, bench_spec("S", optimizer=EMA_ADAM))


@pytest.mark.parametrize("full_precision", [False, True])
def test_device_ema_tracks_its_own_weights(device, full_precision):
    spec = bench_spec("S", optimizer=EMA_ADAM | {"full_precision": full_precision})
    check_ema_tracks_its_own_weights(_device_compile(device), spec)


def test_device_ema_checkpoint_resumes(device):
    check_ema_checkpoint_resumes(_device_compile(device), bench_spec("S", optimizer=EMA_ADAM))


def test_variants_without_ema_refuse_it_by_name():
    class NoEma(CpuModel):  # a variant that keeps no EMA slot (cuda's cublaslt and wgmma today)
        backend, variant, supports_ema = "cuda", "wgmma", False

    with pytest.raises(SpecError) as err:
        NoEma(small_spec({"otype": "EMA", "nested": ADAM}))
    assert err.value.field == "optimizer"
    assert "not implemented on the cuda backend's wgmma variant" in str(err.value)
    NoEma(small_spec(ADAM))  # the others compile there


# -- through the daemon --------------------------------------------------------------------------
WRAPPED = {"n_input_dims": 5, "n_output_dims": 3, "precision": "fp32",
           "network": {"n_neurons": 16, "n_hidden_layers": 2},
           "optimizer": {"otype": "EMA", "decay": 0.9, "nested": {"otype": "ExponentialDecay", **DECAY, "nested": ADAM}}}


def test_daemon_checkpoints_the_ema_slot(http, daemon):
    assert http.put("/v2/models/ema-wrapped", json={"spec": WRAPPED}).status_code == 201
    x, y = task(small_spec(WRAPPED["optimizer"]), 64)
    body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()},
                       {"name": "TARGET", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}],
            "parameters": {"steps": 8}}
    assert http.post("/v2/models/ema-wrapped/train", json=body).status_code == 200
    version = http.post("/v2/models/ema-wrapped/versions").json()["version"]
    state = load_file(str(daemon.store / "models" / "ema-wrapped" / "optimizer" / f"{version}.safetensors"))
    assert {"ema.W0", "ema.b2", "m.W0", "v.b2"} <= set(state) and int(state["step"][0]) == 8
    meta = http.get("/v2/models/ema-wrapped").json()
    assert meta["spec"]["optimizer"]["otype"] == "EMA"
    assert http.delete("/v2/models/ema-wrapped").status_code == 200


def test_daemon_on_wgpu_trains_an_ema_model(tmp_path):
    pytest.importorskip("wgpu", reason="wgpu-py is not installed")
    import httpx

    from tests.conftest import DaemonProcess

    try:
        proc = DaemonProcess(tmp_path / "store", env={"MMAD_BACKEND": "wgpu", "MMAD_PROBE": "wgpu"}).start()
    except RuntimeError as exc:
        pytest.skip(f"no wgpu daemon here: {str(exc)[:200]}")
    try:
        assert httpx.put(f"{proc.url}/v2/models/ema", json={"spec": WRAPPED}, timeout=60).status_code == 201
        x, y = task(small_spec(WRAPPED["optimizer"]), 64)
        body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()},
                           {"name": "TARGET", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}],
                "parameters": {"steps": 8}}
        r = httpx.post(f"{proc.url}/v2/models/ema/train", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert "wgpu" in httpx.get(f"{proc.url}/v2/models/ema", timeout=60).json()["backend"]
    finally:
        proc.stop()
