"""vulkan:coopmat2 (VK_NV_cooperative_matrix2) on any machine: kernels, plans, probe, variant choice.

No software Vulkan offers VK_NV_cooperative_matrix2, so CI cannot run these kernels. It compiles
every coopmat2 kernel (with the glslang inside slangpy) for every tile family ``coopmat2_plan`` can
emit on the devices below and validates the SPIR-V with spirv-val; checks the planner's choices,
the probe's reasons and the backend's variant choice on made-up device descriptions. Running the
kernels against the oracle is tests/test_vulkan.py (and its grid and epoch companions) on a GPU
that offers the extension (``MMAD_TEST_VULKAN_VARIANTS=coopmat2``, scripts/gpu/vulkan_check.sh).
"""

from __future__ import annotations

import dataclasses

import pytest

from mmad.errors import BackendUnavailable, SpecError
from mmad.spec import MLPSpec, bench_spec

vulkan = pytest.importorskip("mmad.backends.vulkan", reason="the vulkan Python package is not installed")
glsl = pytest.importorskip("mmad.backends.vulkan.glsl")
vr = vulkan.vr


def flexible(invocations: int, m: int = 16, n: int = 16, k: int = 16, **kw) -> dict:
    shape = dict(m=m, n=n, k=k, a="f16", b="f16", c="f32", result="f32", saturating=False, scope="workgroup",
                 workgroup_invocations=invocations)
    return {**shape, **kw}


def properties(max_group: int = 256, max_dim: int = 256, reserved: int = 0) -> dict:
    return {"cooperativeMatrixWorkgroupScopeMaxWorkgroupSize": max_group,
            "cooperativeMatrixFlexibleDimensionsMaxDimension": max_dim,
            "cooperativeMatrixWorkgroupScopeReservedSharedMemory": reserved}


# made-up devices: (flexible shapes, properties, max shared bytes)
NVIDIA_LIKE = ([flexible(128), flexible(256)], properties(), 49152)
DEVICES = {
    "wg256": NVIDIA_LIKE,
    "wg128": ([flexible(128)], properties(max_group=128), 49152),
    "reserved16k": ([flexible(128), flexible(256)], properties(reserved=16384), 49152),
    "gran32": ([flexible(256, m=32, n=32, k=32)], properties(), 65536),
}
MODELS = {
    "S": bench_spec("S"), "M": bench_spec("M"), "L": bench_spec("L"), "W": bench_spec("W"),
    "odd": MLPSpec.from_json({"n_input_dims": 3, "n_output_dims": 5, "network": {"n_neurons": 64, "n_hidden_layers": 3},
                              "encoding": {"otype": "Frequency", "n_frequencies": 6}}),
    "relu1": MLPSpec.from_json({"n_input_dims": 8, "n_output_dims": 3, "network": {"n_neurons": 32, "n_hidden_layers": 1,
                                "activation": "Tanh", "output_activation": "Sigmoid"}, "loss": {"otype": "RelativeL2Luminance"}}),
    "hash3d": MLPSpec.from_json({"n_input_dims": 3, "n_output_dims": 1, "network": {"n_neurons": 64, "n_hidden_layers": 2},
                                 "encoding": {"otype": "HashGrid", "n_levels": 16, "log2_hashmap_size": 15}}),
}


@pytest.fixture(scope="module")
def tools():
    try:
        glsl.tool("spirv-val")
        glsl.slang_glslang_library()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"spirv-val or slangpy's glslang unavailable: {exc}")


def plan_for(spec: MLPSpec, device: str = "wg256") -> vulkan.Coopmat2Plan:
    shapes, props, shared = DEVICES[device]
    return vulkan.coopmat2_plan(spec, shapes, props, shared, 1024, grid=bool(spec.grid_shapes))


def _families() -> list[tuple[str, str]]:
    """(model, device) pairs whose plans differ: every tile family the planner emits here."""
    seen, out = set(), []
    for device in DEVICES:
        for model, spec in MODELS.items():
            try:
                plan = plan_for(spec, device)
            except SpecError:
                continue
            key = (plan, spec.n_neurons, model in ("hash3d",), spec.activation)
            if key not in seen:
                seen.add(key)
                out.append((model, device))
    return out


@pytest.mark.parametrize("model,device", _families(), ids=lambda v: v)
def test_coopmat2_kernels_compile_and_validate(tools, model, device):
    spec = MODELS[model]
    plan = plan_for(spec, device)
    geometry = vulkan.Geometry.build(spec, DEVICES[device][2], coopmat2=plan)
    assert geometry.rows_per_tile == plan.rows and geometry.threads == plan.threads
    assert geometry.shared_bytes + DEVICES[device][1]["cooperativeMatrixWorkgroupScopeReservedSharedMemory"] \
        <= DEVICES[device][2]
    gradient = "atomic" if spec.grid_shapes else "sorted"
    sources = vulkan.kernel_sources(spec, geometry, "coopmat2", gradient)
    for name in vulkan.COOPMAT2_KERNELS:
        spirv = glsl.compile_glsl(glsl.expand_includes(sources[name]), f"coopmat2 {name}",
                                  compiler=glsl.SLANG_GLSLANG)  # runs spirv-val
        assert spirv[:4] == b"\x03\x02\x23\x07", "not a SPIR-V module"
        assert b"SPV_NV_cooperative_matrix2" in spirv and b"SPV_NV_tensor_addressing" in spirv, name
    # the shared kernels are every variant's, through cmeel's glslang; the optimizer writes the fp16 copy
    assert "#define CM_M" in sources["optimizer"]
    for name in ("optimizer", "finalize", *(n for n in sources if n.startswith("grid_"))):
        glsl.compile_glsl(glsl.expand_includes(sources[name]), f"coopmat2 {name}")


def test_plans_for_the_benchmark_models():
    """256 invocations where offered; 128 rows a tile but for W (256 wide: 64 rows keep a thread at
    64 accumulator values); weight gradients in 64 x 64 tiles for 64-wide models, 128 x 128 wider."""
    want = {"S": (128, (64, 64, 64)), "M": (128, (64, 64, 64)), "L": (128, (128, 128, 64)), "W": (64, (128, 128, 64))}
    for name, (rows, wgrad) in want.items():
        plan = plan_for(bench_spec(name))
        assert (plan.threads, plan.rows, plan.wgrad, plan.granularity) == (256, rows, wgrad, (16, 16, 16)), name
        assert plan.rows * max(plan.in_pad, bench_spec(name).n_neurons, plan.out_pad) <= 64 * plan.threads
    # 128 invocations only: half the rows (and 64 x 64 weight-gradient tiles) at the same register budget
    assert [(p.rows, p.wgrad[0]) for p in (plan_for(bench_spec(n), "wg128") for n in "SMLW")] == \
        [(128, 64), (128, 64), (64, 64), (32, 64)]


def test_plan_keeps_the_backward_tile_within_shared_memory():
    # W's backward tile: 64 rows x 264 halves = 33 KiB; with 16 KiB reserved by the driver only 32 rows fit
    plan = plan_for(bench_spec("W"), "reserved16k")
    assert plan.rows == 32 and plan.shared_bytes + 16384 <= 49152
    with pytest.raises(SpecError, match="n_output_dims: no coopmat2 tile"):
        vulkan.coopmat2_plan(bench_spec("W"), *NVIDIA_LIKE[:2], 8000, 1024)


def test_plan_pads_to_the_granularity_and_names_what_does_not_fit():
    plan = plan_for(MODELS["odd"], "gran32")  # 3 inputs x 6 frequencies x 2 = 36 encoded columns
    assert (plan.in_pad, plan.out_pad, plan.granularity) == (64, 32, (32, 32, 32))
    with pytest.raises(SpecError, match="network.n_neurons: vulkan:coopmat2 on this device needs a multiple of 32"):
        plan_for(bench_spec("S", n_neurons=48), "gran32")
    small = ([flexible(256)], properties(max_dim=128), 49152)
    with pytest.raises(SpecError, match="network.n_neurons: a layer 256 wide exceeds the 128"):
        vulkan.coopmat2_plan(bench_spec("M", n_neurons=256), *small[:2], small[2], 1024)
    with pytest.raises(SpecError, match="encoding: a layer 256 wide exceeds the 128"):
        vulkan.coopmat2_plan(bench_spec("W"), *small[:2], small[2], 1024)
    with pytest.raises(SpecError, match="no fp16\\*fp16\\+fp32 workgroup-scope shape"):
        vulkan.coopmat2_plan(bench_spec("S"), [flexible(256, scope="subgroup")], properties(), 49152, 1024)
    # the workgroup the extension allows bounds the shape taken
    assert vulkan.coopmat2_plan(bench_spec("S"), NVIDIA_LIKE[0], properties(max_group=128), 49152, 1024).threads == 128


def test_tile_settings(monkeypatch):
    monkeypatch.setenv(vulkan.COOPMAT2_TILE_ENV, "64x128")
    monkeypatch.setenv(vulkan.COOPMAT2_WGRAD_ENV, "128x64x32")
    plan = plan_for(bench_spec("M"))
    assert (plan.rows, plan.threads, plan.wgrad) == (64, 128, (128, 64, 32))
    monkeypatch.setenv(vulkan.COOPMAT2_TILE_ENV, "64x512")
    with pytest.raises(SpecError, match="MMAD_VULKAN_COOPMAT2_TILE: no fp16.*has 512 invocations"):
        plan_for(bench_spec("M"))
    monkeypatch.setenv(vulkan.COOPMAT2_TILE_ENV, "48x256")
    with pytest.raises(SpecError, match="MMAD_VULKAN_COOPMAT2_TILE: 48 rows"):
        plan_for(bench_spec("M"))
    monkeypatch.setenv(vulkan.COOPMAT2_TILE_ENV, "big")
    with pytest.raises(SpecError, match="must be NxN with positive integers; got 'big'"):
        plan_for(bench_spec("M"))
    monkeypatch.delenv(vulkan.COOPMAT2_TILE_ENV)
    monkeypatch.setenv(vulkan.COOPMAT2_WGRAD_ENV, "64x64x128")
    with pytest.raises(SpecError, match="MMAD_VULKAN_COOPMAT2_WGRAD_TILE: 64x64x128"):
        plan_for(bench_spec("M"))


def test_wgrad_dispatch_covers_every_layer_with_the_plans_tiles():
    geometry = vulkan.Geometry.build(bench_spec("W"), 49152, coopmat2=plan_for(bench_spec("W")))
    assert geometry.wgrad_tile == (128, 128)
    assert vulkan.Geometry.build(bench_spec("W"), 49152, (16, 16, 16)).wgrad_tile == (64, 64)


# -- probe ---------------------------------------------------------------------------------
def fake_device(**overrides) -> vr.DeviceInfo:
    info = vr.DeviceInfo(index=0, name="GPU X", device_type="discrete", api_version="1.4.312", driver="0x1",
                         subgroup_size=32, max_shared_bytes=49152, max_workgroup_invocations=1024,
                         max_group_count=(65535, 65535, 65535), max_storage_range=2**32 - 1, timestamp_period_ns=1.0,
                         shader_float16=True, storage_16bit=True, vulkan_memory_model=True,
                         extensions={vr.COOPMAT_EXT, vr.COOPMAT2_EXT},
                         coopmat2_features={f: True for f in vr.nv.FEATURES},
                         coopmat2_properties=properties(), coopmat2_shapes=NVIDIA_LIKE[0])
    return dataclasses.replace(info, **overrides)


def coopmat2_row(info: vr.DeviceInfo, compiler_error: str = ""):
    return vulkan.VulkanBackend._coopmat2_row(info, {"compiler": "x"}, {"device": info.name, "api_version": "1.4",
                                                                         "software": False}, compiler_error)


def test_probe_passes_where_extension_features_shapes_and_compiler_exist(tools):
    row = coopmat2_row(fake_device())
    assert row.available, row.reason
    assert row.details["cooperative_matrix"].startswith(
        "VK_NV_cooperative_matrix2: f16*f16+f32 workgroup scope, 256 invocations, dimensions in steps of 16x16x16 up to 256")
    assert row.details["compiler"].startswith("libslang-glslang") and "slangpy" in row.details["compiler"]
    assert [str(s) for s in row.mma_shapes] == ["16x16x16 f16*f16+f32->f32"] * 2
    assert row.details["flexible_shapes"] == [f"16x16x16 f16*f16+f32->f32 workgroup {n} invocations" for n in (128, 256)]
    assert row.details["coopmat2_properties"]["cooperativeMatrixFlexibleDimensionsMaxDimension"] == 256


@pytest.mark.parametrize("change,reason", [
    (dict(extensions={vr.COOPMAT_EXT}), "GPU X does not offer VK_NV_cooperative_matrix2"),
    (dict(extensions={vr.COOPMAT2_EXT}), "GPU X offers VK_NV_cooperative_matrix2 without VK_KHR_cooperative_matrix"),
    (dict(coopmat2_features={"cooperativeMatrixWorkgroupScope": True, "cooperativeMatrixFlexibleDimensions": True,
                             "cooperativeMatrixConversions": False, "cooperativeMatrixTensorAddressing": True}),
     "GPU X's VK_NV_cooperative_matrix2 lacks the feature(s) cooperativeMatrixConversions, which the kernels use"),
    (dict(coopmat2_shapes=[flexible(256, a="s8", b="s8", c="s32", result="s32")]),
     "no fp16*fp16+fp32 workgroup-scope flexible-dimension shape among 16x16x16 s8*s8+s32->s32 256 invocations"),
    (dict(coopmat2_shapes=[]), "no fp16*fp16+fp32 workgroup-scope flexible-dimension shape among none listed"),
    (dict(shader_float16=False), "GPU X lacks shaderFloat16, storageBuffer16BitAccess or vulkanMemoryModel"),
])
def test_probe_reasons(tools, change, reason):
    row = coopmat2_row(fake_device(**change))
    assert not row.available and row.reason.startswith(reason), row.reason


def test_probe_reason_without_the_compilers(monkeypatch):
    assert coopmat2_row(fake_device(), "no GLSL compiler: glslang not found").reason == \
        "no GLSL compiler: glslang not found"

    def missing():
        raise BackendUnavailable("vulkan", "slangpy is not installed")
    monkeypatch.setattr(glsl, "slang_glslang_library", missing)
    monkeypatch.setattr(glsl, "compiler_version", lambda compiler="glslang": missing())
    row = coopmat2_row(fake_device())
    assert not row.available
    assert row.reason == ("no GLSL compiler for GL_NV_cooperative_matrix2: backend 'vulkan' is unavailable: "
                          "slangpy is not installed")


def test_probe_switch(monkeypatch, tools):
    monkeypatch.setenv(vulkan.COOPMAT2_ENV, "0")
    assert coopmat2_row(fake_device()).reason == "disabled by MMAD_VULKAN_COOPMAT2=0"


def test_nv_notes_say_which_variant_uses_the_extension(tools):
    info = fake_device(extensions={vr.COOPMAT_EXT, vr.COOPMAT2_EXT, "VK_NV_cooperative_vector"})
    notes = vulkan.VulkanBackend._nv_extension_notes(info, coopmat2_row(info))
    assert notes == {"VK_NV_cooperative_matrix2": "offered, used by vulkan:coopmat2",
                     "VK_NV_cooperative_vector": "offered, not used: no vulkan variant has kernels for it"}
    # the cooperative-vector survey, for a variant that does not exist yet
    vec = dataclasses.replace(info, coopvec_features={"cooperativeVector": True, "cooperativeVectorTraining": True},
                              coopvec_properties={"maxCooperativeVectorComponents": 128},
                              coopvec_combinations=[dict(inputType="f16", inputInterpretation="f16",
                                                         matrixInterpretation="f16", biasInterpretation="f16",
                                                         resultType="f16", transpose=True),
                                                    dict(inputType="f32", inputInterpretation="e4m3",
                                                         matrixInterpretation="e4m3", biasInterpretation="f16",
                                                         resultType="f32", transpose=False)])
    assert vulkan.VulkanBackend._nv_extension_notes(vec, coopmat2_row(vec))["cooperative_vector"] == (
        "features cooperativeVector, cooperativeVectorTraining; maxCooperativeVectorComponents 128; fp16 matrices: "
        "f16 input as f16, bias f16, f16 result, transposed")
    off = fake_device(coopmat2_shapes=[])
    assert vulkan.VulkanBackend._nv_extension_notes(off, coopmat2_row(off))["VK_NV_cooperative_matrix2"].startswith(
        "offered, not used: no fp16*fp16+fp32 workgroup-scope")


# -- variant choice ------------------------------------------------------------------------
@pytest.fixture
def lavapipe_backend():
    b = vulkan.VulkanBackend()
    if not {r.variant: r for r in b.probe()}["simt"].available:
        pytest.skip("no usable Vulkan device")
    yield b
    b.close()


def _pretend_coopmat2(monkeypatch, backend, failure: Exception):
    """The probe says coopmat2 is available; the model's coopmat2 geometry fails with ``failure``."""
    rows = backend.probe()
    faked = [dataclasses.replace(r, available=True, reason="") if r.variant == "coopmat2" else r for r in rows]
    monkeypatch.setattr(backend, "probe", lambda: faked)

    def geometry(spec, device, index):
        raise failure
    monkeypatch.setattr(backend, "_coopmat2_geometry", geometry)


def test_coopmat2_is_taken_only_when_named(monkeypatch, lavapipe_backend):
    """Measured slower than coopmat on the H200, coopmat2 is never the automatic choice, even where
    it is offered; named, a model it cannot run is refused with the reason, not replaced."""
    _pretend_coopmat2(monkeypatch, lavapipe_backend, SpecError("network.n_neurons", "needs a multiple of 32"))
    spec = bench_spec("S")
    with lavapipe_backend.compile(spec) as model:
        assert model.variant == next(v for v in vulkan.AUTOMATIC if lavapipe_backend_row(lavapipe_backend, v).available)
    with pytest.raises(SpecError, match="needs a multiple of 32"):
        lavapipe_backend.compile(spec, "coopmat2")


def lavapipe_backend_row(backend, variant: str):
    return next(r for r in backend.probe() if r.variant == variant)


def test_a_bad_coopmat2_setting_is_refused(monkeypatch, lavapipe_backend):
    _pretend_coopmat2(monkeypatch, lavapipe_backend, SpecError(vulkan.COOPMAT2_TILE_ENV, "must be NxN"))
    with pytest.raises(SpecError, match="MMAD_VULKAN_COOPMAT2_TILE: must be NxN"):
        lavapipe_backend.compile(bench_spec("S"), "coopmat2")


def test_a_driver_refusing_coopmat2_leaves_the_device_to_the_other_variants(monkeypatch, lavapipe_backend):
    info = lavapipe_backend._placeable()[0]
    offered = dataclasses.replace(info, extensions=info.extensions | {vr.COOPMAT_EXT, vr.COOPMAT2_EXT},
                                  coopmat2_features={f: True for f in vulkan.COOPMAT2_FEATURES})
    monkeypatch.setattr(lavapipe_backend, "_placeable", lambda: [offered])
    real = vr.Device
    calls = []

    def device(info, enable_coopmat=False, pipeline_stats=False, enable_coopmat2=False):
        calls.append(enable_coopmat2)
        if enable_coopmat2:
            raise vulkan.LaunchError("vkCreateDevice on GPU failed: VK_ERROR_FEATURE_NOT_PRESENT")
        # the real device has neither cooperative extension
        return real(info, enable_coopmat=False, pipeline_stats=pipeline_stats)
    monkeypatch.setattr(vr, "Device", device)
    opened = lavapipe_backend._open_device(0)
    assert calls == [True, False] and not opened.coopmat2
    with pytest.raises(BackendUnavailable, match="VK_ERROR_FEATURE_NOT_PRESENT"):
        lavapipe_backend._coopmat2_geometry(bench_spec("S"), opened, 0)


def test_slang_glslang_library_setting(monkeypatch, tools, tmp_path):
    """MMAD_SLANG_GLSLANG names the library instead of slangpy's (a Slang SDK's, or the file alone)."""
    found = glsl.slang_glslang_library()
    try:
        copy = tmp_path / found.name
        copy.write_bytes(found.read_bytes())
        monkeypatch.setenv(glsl.SLANG_GLSLANG_ENV, str(copy))
        glsl.slang_glslang_library.cache_clear()
        assert glsl.slang_glslang_library() == copy
        monkeypatch.setenv(glsl.SLANG_GLSLANG_ENV, str(tmp_path / "missing.so"))
        glsl.slang_glslang_library.cache_clear()
        with pytest.raises(BackendUnavailable, match="MMAD_SLANG_GLSLANG=.*missing.so: no such file"):
            glsl.slang_glslang_library()
    finally:
        monkeypatch.delenv(glsl.SLANG_GLSLANG_ENV)
        glsl.slang_glslang_library.cache_clear()
    assert glsl.slang_glslang_library() == found
