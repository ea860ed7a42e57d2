"""Model spec: tiny-cuda-nn configs parse; every invalid field is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmad.errors import SpecError
from mmad.spec import MLPSpec, bench_spec

CONFIGS = Path(__file__).parent / "configs"


def base() -> dict:
    return {"n_input_dims": 8, "n_output_dims": 3,
            "network": {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
                        "n_neurons": 64, "n_hidden_layers": 2},
            "encoding": {"otype": "Identity"}, "loss": {"otype": "L2"},
            "optimizer": {"otype": "Adam", "learning_rate": 1e-3}, "precision": "fp16", "seed": 1}


def test_tcnn_oneblob_sample_config():
    doc = json.loads((CONFIGS / "tcnn_oneblob.json").read_text())
    spec = MLPSpec.from_json(doc, n_input_dims=2, n_output_dims=3)  # tiny-cuda-nn passes dims apart
    assert (spec.n_input_dims, spec.n_output_dims, spec.n_encoded_dims) == (2, 3, 64)
    assert spec.loss == "RelativeL2" and spec.optimizer.l2_reg == 1e-6
    assert spec.layer_dims == [(64, 64)] * 4 + [(64, 3)]


def test_tcnn_frequency_config_with_sgd_and_other_otype():
    spec = MLPSpec.from_json((CONFIGS / "tcnn_frequency.json").read_text(), n_input_dims=3, n_output_dims=1)
    assert spec.n_encoded_dims == 3 * 12 * 2
    assert spec.network_otype == "CutlassMLP" and spec.output_activation == "Sigmoid"
    assert spec.optimizer.otype == "SGD" and spec.optimizer.momentum == 0.9


def test_composite_config_and_round_trip():
    spec = MLPSpec.from_json(json.loads((CONFIGS / "tcnn_composite.json").read_text()))
    assert spec.n_encoded_dims == 3 * 4 * 2 + 8 + 1
    assert spec.huber_delta == 0.5 and spec.precision == "bf16" and spec.seed == 42
    again = MLPSpec.from_json(spec.to_json())
    assert again == spec and again.content_hash() == spec.content_hash()


def test_values_are_case_insensitive_like_tcnn():
    doc = base()
    doc["network"]["activation"] = "relu"
    doc["loss"]["otype"] = "l2"
    spec = MLPSpec.from_json(doc)
    assert spec.activation == "ReLU" and spec.loss == "L2"


def test_bench_models():
    assert bench_spec("M").layer_dims == [(64, 64)] * 5
    assert bench_spec("W").n_neurons == 256
    assert bench_spec("S", n_neurons=128).n_neurons == 128


def _set(doc: dict, path: str, value) -> dict:
    node = doc
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return doc


class _Deleted:
    """The marker of a field to remove; a fixed repr keeps the test ids the same in every process
    (pytest-xdist workers must collect identical ids; ``object()``'s repr holds its address)."""

    def __repr__(self) -> str:
        return "<deleted>"


_DELETE = _Deleted()

# (json path to change, new value, field the error must name, words it must contain)
INVALID = [
    ("network.n_neurons", 24, "network.n_neurons", "multiple of 16"),
    ("network.n_neurons", 512, "network.n_neurons", "from 16 to 256"),
    ("network.n_neurons", 0, "network.n_neurons", "from 16 to 256"),
    ("network.n_neurons", "64", "network.n_neurons", "integer"),
    ("network.n_hidden_layers", 0, "network.n_hidden_layers", "from 1"),
    ("network.n_hidden_layers", 2.5, "network.n_hidden_layers", "integer"),
    ("network.activation", "GELU", "network.activation", "ReLU"),
    ("network.output_activation", "Softmax", "network.output_activation", "allowed"),
    ("network.otype", "ResNet", "network.otype", "FullyFusedMLP"),
    ("network.dropout", 0.1, "network.dropout", "unknown field"),
    ("n_input_dims", 0, "n_input_dims", "from 1"),
    ("n_input_dims", _DELETE, "n_input_dims", "required"),
    ("n_output_dims", -3, "n_output_dims", "from 1"),
    ("n_output_dims", True, "n_output_dims", "integer"),
    ("loss.otype", "CrossEntropy", "loss.otype", "L2"),
    ("loss.delta", 1.0, "loss.delta", "Huber"),
    ("optimizer.otype", "RMSProp", "optimizer.otype", "Adam, SGD"),
    ("optimizer.learning_rate", 0.0, "optimizer.learning_rate", "(0.0"),
    ("optimizer.learning_rate", float("nan"), "optimizer.learning_rate", "finite"),
    ("optimizer.beta1", 1.5, "optimizer.beta1", "must be in"),
    ("optimizer.momentum", 0.9, "optimizer.momentum", "unknown field"),
    ("encoding.otype", "NRC", "encoding.otype", "Identity, Frequency, OneBlob, Composite, HashGrid"),
    ("encoding", {"otype": "Frequency", "n_frequencies": 0}, "encoding.n_frequencies", "from 1"),
    ("encoding", {"otype": "OneBlob", "n_bins": 3}, "encoding.n_bins", "power of two"),
    ("encoding", {"otype": "Composite", "nested": []}, "encoding.nested", "non-empty"),
    ("encoding", {"otype": "Composite", "nested": [{"otype": "Identity", "n_dims_to_encode": 5},
                                                   {"otype": "OneBlob", "n_dims_to_encode": 5}]},
     "encoding.nested", "encode 10 dims"),
    ("encoding", {"otype": "Composite", "nested": [{"otype": "Identity", "n_dims_to_encode": 9}]},
     "encoding.nested[0].n_dims_to_encode", "from 0 to 8"),
    ("encoding", {"otype": "Composite", "nested": [{"otype": "Composite", "nested": []}]},
     "encoding.nested[0].nested", "non-empty"),
    ("encoding", "Identity", "encoding", "JSON object"),
    ("precision", "fp8", "precision", "fp16, bf16, fp32"),
    ("seed", -1, "seed", "from 0"),
    ("batch_size", 1024, "batch_size", "unknown field"),
]


@pytest.mark.parametrize("path,value,field,words", INVALID, ids=[f"{p}={v!r}"[:40] for p, v, *_ in INVALID])
def test_invalid_field_is_named(path, value, field, words):
    with pytest.raises(SpecError) as info:
        MLPSpec.from_json(_set(base(), path, value))
    assert info.value.field == field
    assert words in str(info.value)
    if value is not _DELETE and not isinstance(value, dict):
        assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_not_json_at_all():
    with pytest.raises(SpecError, match="not valid JSON"):
        MLPSpec.from_json("{network: }")


def test_spec_is_immutable_and_hash_tracks_changes():
    spec = MLPSpec.from_json(base())
    with pytest.raises(AttributeError):
        spec.n_neurons = 32  # type: ignore[misc]
    assert spec.replace(n_neurons=32).content_hash() != spec.content_hash()
