"""Cooperative-matrix kernels: compiled and validated for every shape family, on any machine.

lavapipe offers no ``VK_KHR_cooperative_matrix``, so CI cannot run these kernels; it compiles
every coopmat kernel for every shape family the probe may pick (16x16x16 NVIDIA/AMD, 16x8x16
NVIDIA, 8x16x16 / 8x8x16 Intel, 8x8x8 newer lavapipe) and several model geometries, and
validates the SPIR-V with spirv-val. Running them is covered by tests/test_vulkan.py on a device
that offers the extension (its ``coopmat`` parametrisation).
"""

from __future__ import annotations

import pytest

from mmad.spec import MLPSpec, bench_spec

vulkan = pytest.importorskip("mmad.backends.vulkan", reason="the vulkan Python package is not installed")
glsl = pytest.importorskip("mmad.backends.vulkan.glsl")
ROW_ALIGN = vulkan.ROW_ALIGN

GEOMETRIES = {
    "S": bench_spec("S"), "M": bench_spec("M"), "L": bench_spec("L"), "W": bench_spec("W"),
    "odd": MLPSpec.from_json({"n_input_dims": 3, "n_output_dims": 5,
                              "network": {"n_neurons": 48, "n_hidden_layers": 3},
                              "encoding": {"otype": "Frequency", "n_frequencies": 6}}),
}


@pytest.fixture(scope="module")
def tools():
    try:
        glsl.tool("glslang")
        glsl.tool("spirv-val")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"glslang/spirv-val unavailable: {exc}")


@pytest.mark.parametrize("family", vulkan.COOPMAT_FAMILIES, ids=lambda f: "x".join(map(str, f)))
@pytest.mark.parametrize("model", list(GEOMETRIES))
def test_coopmat_kernels_compile_and_validate(tools, family, model):
    spec = GEOMETRIES[model]
    # NVIDIA's limits for every model; AMD-like (64 KiB, wave64) and Intel-like (32 KiB, 16) for M
    devices = [(49152, 32)] + ([(65536, 64), (32768, 16)] if model == "M" else [])
    for max_shared, subgroup in devices:
        geometry = vulkan.Geometry.build(spec, max_shared, family, subgroup)
        assert geometry.shared_bytes <= max_shared
        assert geometry.rows_per_tile % family[0] == 0 and ROW_ALIGN % geometry.rows_per_tile == 0
        row_groups = geometry.subgroups // geometry.sg_cols
        assert geometry.nacc == geometry.rows_per_tile // family[0] // row_groups * geometry.ncj <= 8
        assert geometry.threads == geometry.subgroups * subgroup <= 512
        sources = vulkan.kernel_sources(spec, geometry, "coopmat")
        # finalize is the simt one, built in test_vulkan; the optimizer also writes the fp16 copy here
        for name in ("forward", "backward", "wgrad", "optimizer"):
            spirv = glsl.compile_glsl(glsl.expand_includes(sources[name]), f"coopmat {name}")  # runs spirv-val
            assert spirv[:4] == b"\x03\x02\x23\x07", "not a SPIR-V module"
            if name != "optimizer":
                assert b"SPV_KHR_cooperative_matrix" in spirv, name


GRID_MODELS = {
    "hash3d": {"n_input_dims": 3, "n_output_dims": 1, "network": {"n_neurons": 64, "n_hidden_layers": 2},
               "encoding": {"otype": "HashGrid", "n_levels": 16, "log2_hashmap_size": 15}},
    "instant-ngp": {"n_input_dims": 6, "n_output_dims": 4, "network": {"n_neurons": 64, "n_hidden_layers": 2},
                    "encoding": {"otype": "Composite", "nested": [
                        {"otype": "HashGrid", "n_dims_to_encode": 3, "n_levels": 6, "log2_hashmap_size": 12},
                        {"otype": "SphericalHarmonics", "degree": 4}]}},
}


@pytest.mark.parametrize("model,family,gradient",
                         [("hash3d", f, "atomic") for f in vulkan.COOPMAT_FAMILIES]
                         + [("instant-ngp", (16, 16, 16), "sorted")],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_coopmat_grid_kernels_compile_and_validate(tools, model, family, gradient):
    """A grid model on coopmat: the backward that runs on into d loss / d encoded input, the
    optimizer that steps the tables and the grid kernels (both table gradients), for every shape
    family."""
    spec = MLPSpec.from_json(GRID_MODELS[model])
    geometry = vulkan.Geometry.build(spec, 49152, family, 32)
    sources = vulkan.kernel_sources(spec, geometry, "coopmat", gradient)
    assert {"grid_encode", "grid_scatter" if gradient == "atomic" else "grid_gather"} <= set(sources)
    for name in ("forward", "backward", "wgrad", "optimizer", *(n for n in sources if n.startswith("grid_"))):
        spirv = glsl.compile_glsl(glsl.expand_includes(sources[name]), f"coopmat grid {name}")
        assert spirv[:4] == b"\x03\x02\x23\x07", "not a SPIR-V module"
    assert "#define GRID_PARTS" in sources["backward"]


@pytest.mark.parametrize("model", list(GEOMETRIES))
def test_simt_kernels_for_gpu_limits_compile(tools, model):
    """lavapipe runs the 32 KiB geometry; this builds the 48 KiB one (8-row register tiles) too."""
    spec = GEOMETRIES[model]
    geometry = vulkan.Geometry.build(spec, 49152)
    assert geometry.micro_rows == 8 and geometry.rows_per_tile % 8 == 0
    for name, source in vulkan.kernel_sources(spec, geometry, "simt").items():
        glsl.compile_glsl(glsl.expand_includes(source), f"simt {name}")


def test_wide_layers_get_more_subgroups_not_fewer_rows():
    """Each weight block a subgroup reads is reused over the tile's rows, so the tiling keeps rows:
    S and M (64 wide) keep 4 column subgroups over 128 rows; L and W (128 and 256 wide) get 8
    column subgroups and twice the rows of 4 (128 and 64), where the shared activation tile fits
    48 KiB. MMAD_VULKAN_COOPMAT_SUBGROUPS=4 (the cap) gives the 4-subgroup layout back."""
    want = {"S": (128, 4, 1), "M": (128, 4, 1), "L": (128, 8, 1), "W": (64, 8, 1)}
    four = {"S": (128, 4, 1), "M": (128, 4, 1), "L": (64, 4, 1), "W": (32, 4, 1)}
    for name in want:
        kmax = vulkan.Geometry.build(bench_spec(name), 49152, (16, 16, 16)).kmax
        assert vulkan.coopmat_tiling(kmax, (16, 16, 16), 32, 49152) == want[name], name
        assert vulkan.coopmat_tiling(kmax, (16, 16, 16), 32, 49152, max_subgroups=4) == four[name], name
    # 32 KiB (Intel-like, subgroup 16) and a 512-wide layer: fewer rows, never past the limits
    rows, sg_cols, sg_rows = vulkan.coopmat_tiling(256, (8, 16, 16), 16, 32768)
    assert 2 * rows * (256 + 8) + 4 * sg_cols * sg_rows * 16 <= 32768
    assert vulkan.coopmat_tiling(2048, (16, 16, 16), 32, 49152) is None  # no 16-row tile fits


def test_coopmat_subgroups_setting(monkeypatch):
    monkeypatch.delenv(vulkan.COOPMAT_SUBGROUPS_ENV, raising=False)
    assert vulkan.coopmat_subgroups_cap() == 16
    monkeypatch.setenv(vulkan.COOPMAT_SUBGROUPS_ENV, "4")
    assert vulkan.coopmat_subgroups_cap() == 4
    monkeypatch.setenv(vulkan.COOPMAT_SUBGROUPS_ENV, "6")
    with pytest.raises(vulkan.SpecError, match="must be 4, 8 or 16; got '6'"):
        vulkan.coopmat_subgroups_cap()


def test_shape_selection_follows_the_probed_list():
    f16 = dict(a="f16", b="f16", c="f32", result="f32", scope="subgroup")
    nvidia = [dict(m=16, n=8, k=16, **f16), dict(m=16, n=16, k=16, **f16), dict(m=16, n=8, k=8, **f16),
              dict(m=16, n=16, k=16, a="f16", b="f16", c="f16", result="f16", scope="subgroup")]
    assert vulkan.usable_coopmat_shapes(nvidia) == [(16, 16, 16), (16, 8, 16)]
    intel = [dict(m=8, n=16, k=16, **f16)]
    assert vulkan.usable_coopmat_shapes(intel) == [(8, 16, 16)]
    int8_only = [dict(m=16, n=16, k=32, a="s8", b="s8", c="s32", result="s32", scope="subgroup")]
    assert vulkan.usable_coopmat_shapes(int8_only) == []
