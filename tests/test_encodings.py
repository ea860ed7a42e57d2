"""The input encodings against tiny-cuda-nn's definitions.

The references below are transcribed from tiny-cuda-nn's device code, one output element at a
time in float64 (``kernel_one_blob``/``one_blob_subwarp_aligned`` and ``quartic_cdf`` in
encodings/oneblob.h and common_device.h, ``frequency_encoding`` in frequency.h, ``identity`` in
identity.h, ``CompositeEncoding`` in composite.h); ``numerics.encode`` is the vectorised
definition every backend uses.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mmad.backends import numerics as nm
from mmad.backends.cpu import CpuBackend
from mmad.errors import SpecError
from mmad.spec import EncodingSpec, MLPSpec


# -- tiny-cuda-nn's device code, element by element ----------------------------------------
def ref_quartic_cdf(x: float, inv_radius: float) -> float:
    u = x * inv_radius
    u2 = u * u
    u4 = u2 * u2
    value = 15 / 16 * u * (1 - 2 / 3 * u2 + 1 / 5 * u4) + 0.5
    return max(0.0, min(1.0, value))


def ref_one_blob(x_row: list[float], n_bins: int) -> list[float]:
    """kernel_one_blob: lane j = dim * n_bins + bin; its left CDF sums three kernel copies (the
    wrap-around); its right CDF is the next lane's left CDF within the run of n_bins lanes
    (__shfl_sync of width n_bins), plus 1 on the last bin, whose next lane is the first."""
    log2 = int(math.log2(n_bins))
    n_out = len(x_row) * n_bins

    def left_cdf(j: int) -> float:
        bin_index = j & (n_bins - 1)
        x = x_row[j >> log2]
        left_boundary = math.ldexp(bin_index, -log2)
        return (ref_quartic_cdf(left_boundary - x, n_bins) + ref_quartic_cdf(left_boundary - x - 1.0, n_bins)
                + ref_quartic_cdf(left_boundary - x + 1.0, n_bins))

    out = []
    for j in range(n_out):
        bin_index = j & (n_bins - 1)
        run_start = j - bin_index
        right = left_cdf(run_start + (bin_index + 1) % n_bins)
        if bin_index == n_bins - 1:
            right += 1
        out.append(right - left_cdf(j))
    return out


def ref_frequency(x_row: list[float], n_frequencies: int) -> list[float]:
    out = []
    for j in range(len(x_row) * n_frequencies * 2):
        feature = j // (n_frequencies * 2)
        log2_frequency = (j // 2) % n_frequencies
        phase_shift = (j % 2) * (math.pi / 2)
        x = math.ldexp(x_row[feature], log2_frequency)
        out.append(math.sin(x * math.pi + phase_shift))
    return out


def ref_identity(x_row: list[float], scale: float, offset: float) -> list[float]:
    return [v * scale + offset for v in x_row]


def ref_encode(doc: dict, x_row: list[float]) -> list[float]:
    """A tiny-cuda-nn encoding config applied to one input row, as CompositeEncoding splits it."""
    otype = doc.get("otype", "OneBlob").lower()
    if otype == "identity":
        return ref_identity(x_row, doc.get("scale", 1.0), doc.get("offset", 0.0))
    if otype == "frequency":
        return ref_frequency(x_row, doc.get("n_frequencies", 12))
    if otype == "oneblob":
        return ref_one_blob(x_row, doc.get("n_bins", 16))
    nested = doc["nested"]
    total = 0
    for part in nested:
        total += part.get("n_dims_to_encode", 0)
        if "dims_to_encode_begin" in part:
            total = None
            break
    unspecified = None if total is None else len(x_row) - total
    out, offset = [], 0
    for part in nested:
        if "n_dims_to_encode" in part:
            offset = part.get("dims_to_encode_begin", offset)
            dims = part["n_dims_to_encode"]
        else:
            dims, unspecified = unspecified, None
        if dims > 0:
            out += ref_encode(part, x_row[offset:offset + dims])
        offset += dims
    return out


def encode(doc: dict, x: np.ndarray) -> np.ndarray:
    spec = MLPSpec.from_json({"n_input_dims": x.shape[1], "n_output_dims": 1, "encoding": doc})
    out = nm.encode(spec.encoding, x)
    assert out.shape == (x.shape[0], spec.n_encoded_dims) and out.dtype == x.dtype
    return out


def reference(doc: dict, x: np.ndarray) -> np.ndarray:
    return np.array([ref_encode(doc, [float(v) for v in row]) for row in x])


EDGES = [0.0, 1.0, 0.5, 1e-7, 1 - 1e-7, 1 / 16, 15 / 16, 0.03, 0.97,  # in [0, 1], next to the wrap
         -1e-7, 1 + 1e-7, -0.03, 1.03, -0.5, 1.5, -2.0, 3.0, 2.25, -7.75, 100.0]  # outside


def inputs(dims: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    random = np.concatenate([rng.uniform(0, 1, (200, dims)), rng.uniform(-3, 4, (100, dims))])
    edges = np.tile(np.array(EDGES)[:, None], (1, dims))
    return np.concatenate([random, edges, rng.permutation(edges.ravel()).reshape(-1, dims)])


# -- against the references ----------------------------------------------------------------
@pytest.mark.parametrize("n_bins", [1, 2, 4, 8, 16, 32, 64])
def test_one_blob_matches_tcnn(n_bins):
    x = inputs(3, seed=n_bins)
    doc = {"otype": "OneBlob", "n_bins": n_bins}
    np.testing.assert_allclose(encode(doc, x), reference(doc, x), rtol=0, atol=1e-12)
    # float32, as the kernels compute it: within rounding of the float64 reference (b - x is
    # rounded to float32, then scaled by n_bins)
    np.testing.assert_allclose(encode(doc, x.astype(np.float32)), reference(doc, x.astype(np.float32)),
                               rtol=0, atol=2e-7 * max(n_bins, 8))


@pytest.mark.parametrize("n_frequencies", [1, 3, 12])
def test_frequency_matches_tcnn(n_frequencies):
    x = inputs(2, seed=100 + n_frequencies)
    doc = {"otype": "Frequency", "n_frequencies": n_frequencies}
    np.testing.assert_allclose(encode(doc, x), reference(doc, x), rtol=0, atol=1e-9)


@pytest.mark.parametrize("doc", [{"otype": "Identity"}, {"otype": "Identity", "scale": 0.5, "offset": -0.25},
                                 {"otype": "identity", "scale": -3.0}])
def test_identity_matches_tcnn(doc):
    x = inputs(2, seed=7)
    np.testing.assert_allclose(encode(doc, x), reference(doc, x), rtol=1e-15, atol=0)


@pytest.mark.parametrize("doc,dims", [
    ({"otype": "Composite", "nested": [{"n_dims_to_encode": 3, "otype": "Frequency", "n_frequencies": 4},
                                       {"n_dims_to_encode": 1, "otype": "OneBlob", "n_bins": 8},
                                       {"otype": "Identity"}]}, 5),
    # the part without n_dims_to_encode takes what the others leave, wherever it stands
    ({"otype": "Composite", "nested": [{"otype": "Identity", "scale": 2.0},
                                       {"otype": "OneBlob", "n_bins": 4, "n_dims_to_encode": 2}]}, 5),
    # dims no part reads are dropped; a part of 0 dims is skipped; otype defaults to OneBlob
    ({"otype": "Composite", "nested": [{"n_dims_to_encode": 2, "n_bins": 4},
                                       {"otype": "Frequency", "n_dims_to_encode": 0},
                                       {"otype": "Identity", "n_dims_to_encode": 1}]}, 6),
    # dims_to_encode_begin reads dims out of order, or twice
    ({"otype": "Composite", "nested": [{"otype": "Identity", "n_dims_to_encode": 2, "dims_to_encode_begin": 2},
                                       {"otype": "OneBlob", "n_bins": 2, "n_dims_to_encode": 3,
                                        "dims_to_encode_begin": 0},
                                       {"otype": "Frequency", "n_frequencies": 2, "n_dims_to_encode": 1}]}, 4),
    # a Composite inside a Composite
    ({"otype": "Composite", "nested": [{"otype": "Frequency", "n_frequencies": 1, "n_dims_to_encode": 1},
                                       {"otype": "Composite", "n_dims_to_encode": 3,
                                        "nested": [{"otype": "OneBlob", "n_bins": 4, "n_dims_to_encode": 1},
                                                   {"otype": "Identity", "offset": 1.0}]},
                                       {"otype": "Identity"}]}, 5),
])
def test_composite_matches_tcnn(doc, dims):
    x = inputs(dims, seed=dims)
    np.testing.assert_allclose(encode(doc, x), reference(doc, x), rtol=0, atol=1e-9)
    # its canonical form parses back to the same encoding
    spec = MLPSpec.from_json({"n_input_dims": dims, "n_output_dims": 1, "encoding": doc})
    again = MLPSpec.from_json({"n_input_dims": dims, "n_output_dims": 1, "encoding": spec.encoding.to_json()})
    assert again.encoding == spec.encoding


# -- hand-computed from tiny-cuda-nn's formulas --------------------------------------------
@pytest.mark.parametrize("x,expected", [
    # C(b) = Q(b - x) + Q(b - x - 1) + Q(b - x + 1) at b = 0, 1/4, 1/2, 3/4; the last bin's right
    # value C(0) + 1. Q(±1/4 · 4) = 0 or 1, Q(0) = 1/2, Q(-1/2) = 1/2 - 15/32 · 203/240
    (0.5, [0.0, 0.5, 0.5, 0.0]),
    (0.375, [0.103515625, 0.79296875, 0.103515625, 0.0]),
    (0.0, [0.5, 0.0, 0.0, 0.5]),    # half the blob wraps to the last bin
    (1.0, [0.5, 0.0, 0.0, 0.5]),    # one period on
    (1.5, [0.0, 0.5, 0.5, 0.0]),
    (3.0, [0.0, 0.0, 0.0, 1.0]),    # beyond the wrap: every C is 0, the last bin keeps the 1
    (-2.0, [0.0, 0.0, 0.0, 1.0]),   # every C is 3
])
def test_one_blob_hand_values(x, expected):
    out = encode({"otype": "OneBlob", "n_bins": 4}, np.array([[x]]))
    np.testing.assert_allclose(out[0], expected, rtol=0, atol=1e-15)


def test_frequency_hand_values():
    out = encode({"otype": "Frequency", "n_frequencies": 2}, np.array([[0.25, 1.0]]))
    r = math.sqrt(0.5)
    np.testing.assert_allclose(out[0], [r, r, 1, 0, 0, -1, 0, 1], rtol=0, atol=1e-15)


def test_one_blob_bins_hold_the_whole_blob():
    x = inputs(1, seed=3)
    out = encode({"otype": "OneBlob"}, x)
    assert out.shape[1] == 16  # tiny-cuda-nn's default n_bins
    np.testing.assert_allclose(out.sum(axis=1), 1.0, atol=1e-12)
    assert (out >= -1e-15).all()


def test_cpu_model_uses_the_encoding():
    spec = MLPSpec.from_json({"n_input_dims": 2, "n_output_dims": 1, "encoding": {"otype": "OneBlob", "n_bins": 8},
                              "network": {"n_neurons": 16, "n_hidden_layers": 1, "activation": "None"},
                              "precision": "fp32"})
    m = CpuBackend("float64").compile(spec)
    p = m.get_params()
    x = inputs(2, seed=9)
    expected = (reference({"otype": "OneBlob", "n_bins": 8}, x) @ p["W0"].T + p["b0"]) @ p["W1"].T + p["b1"]
    np.testing.assert_allclose(m.forward(x), expected, rtol=1e-5, atol=1e-6)  # a float32 output


# -- the spec: tiny-cuda-nn's defaults and rules -------------------------------------------
def test_defaults():
    assert EncodingSpec.parse("encoding", {"otype": "OneBlob"}, 2).n_bins == 16
    assert EncodingSpec.parse("encoding", {"otype": "Frequency"}, 2).n_frequencies == 12
    assert EncodingSpec.parse("encoding", {}, 2).otype == "OneBlob"
    ident = EncodingSpec.parse("encoding", {"otype": "Identity"}, 2)
    assert (ident.scale, ident.offset, ident.passthrough) == (1.0, 0.0, True)
    assert ident.to_json() == {"otype": "Identity"}  # unchanged canonical form, unchanged spec hash


@pytest.mark.parametrize("doc,where,words", [
    ({"otype": "OneBlob", "n_bins": 12}, "encoding.n_bins", "power of two"),
    ({"otype": "OneBlob", "n_bins": 0}, "encoding.n_bins", "from 1"),
    ({"otype": "Identity", "scale": "x"}, "encoding.scale", "number"),
    ({"otype": "Composite", "reduction": "Sum", "nested": [{"otype": "Identity"}]}, "encoding.reduction",
     "Concatenation"),
    ({"otype": "Composite", "nested": [{"otype": "Identity"}, {"otype": "OneBlob"}]},
     "encoding.nested[1].n_dims_to_encode", "only one"),
    ({"otype": "Composite", "nested": [{"otype": "Identity", "n_dims_to_encode": 2},
                                       {"otype": "OneBlob", "n_dims_to_encode": 2}]}, "encoding.nested", "encode 4"),
    ({"otype": "Composite", "nested": [{"otype": "Identity", "n_dims_to_encode": 2, "dims_to_encode_begin": 2}]},
     "encoding.nested[0].n_dims_to_encode", "do not exist"),
    ({"otype": "Composite", "nested": [{"otype": "Identity", "dims_to_encode_begin": 1}]},
     "encoding.nested[0].dims_to_encode_begin", "n_dims_to_encode"),
    ({"otype": "Composite", "nested": [{"otype": "Identity", "n_dims_to_encode": 0}]}, "encoding.nested",
     "no input dims"),
])
def test_rejected(doc, where, words):
    with pytest.raises(SpecError) as err:
        MLPSpec.from_json({"n_input_dims": 3, "n_output_dims": 1, "encoding": doc})
    assert err.value.field == where and words in str(err.value)
