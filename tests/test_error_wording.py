"""Errors speak the request's terms: "the data must be numbers", "rows of different lengths",
"the request body", never NumPy's type codes and shape errors or the JSON parser's words."""

from __future__ import annotations

import re

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import save as st_save

from mmad.backends.contract import check_rows
from mmad.errors import InvalidInput, SpecError
from mmad.server import Settings, create_app
from mmad.spec import MLPSpec

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

NUMPY_WORDS = re.compile(r"<[UfiSb]\d|\bdtype\b|inhomogeneous|array element|\bndarray\b|\(document\)|"
                         r"\bNoneType\b|\bstr\b|\bdict\b|\bbool_?\b|object_|zero-length|request header")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    store = tmp_path_factory.mktemp("wording") / "store"
    with TestClient(create_app(Settings(store_dir=store, backend="cpu", probe="cpu")),
                    raise_server_exceptions=False) as c:
        yield c


def infer_json(data, shape):
    return orjson.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": shape, "data": data}]})


@pytest.mark.parametrize("body,words", [
    (infer_json([["a", "b"]], [1, 2]), 'only numbers; got the text "a"'),
    (infer_json([[1.0, 2.0], [3.0]], [2, 2]), "rows have different lengths"),
    (infer_json([[1.0, None]], [1, 2]), "only numbers; got null"),
    (infer_json([[True, False]], [1, 2]), "only numbers; got true"),
    (b'{"inputs": [}', "the request body is not valid JSON"),
    (b"", "the request body is empty"),
])
def test_infer_errors(client, body, words):
    r = client.post("/v2/models/demo/infer", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error and not NUMPY_WORDS.search(error), error


@pytest.mark.parametrize("body,words", [
    (b'{"spec": "{not json"}', "the model config is not valid JSON"),
    (b'{"spec": [1, 2]}', "spec: must be a JSON object"),
    (b"{spec: 1}", "the request body is not valid JSON"),
])
def test_create_model_errors(client, body, words):
    r = client.put("/v2/models/wording", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error and not NUMPY_WORDS.search(error), error


def test_dataset_of_text_is_refused_in_words(client):
    body = st_save({"x": np.zeros((4, 2), np.float32), "y": np.zeros((4, 3), np.int32)})
    r = client.post("/v2/models/demo/datasets", content=body)
    assert r.status_code == 400 and not NUMPY_WORDS.search(r.json()["error"]), r.text


@pytest.mark.parametrize("x,words", [
    ([[1.0, 2.0], [3.0]], "rows have different lengths"),
    (np.array([["a", "b"]]), "got text"),
    ([[None, 1.0]], "not all numbers"),
    (np.array([[True, False]]), "got true/false values"),
    (np.array([[1, 2]], np.int32), "got integers (int32)"),
])
def test_python_api_errors(x, words):
    with pytest.raises(InvalidInput) as err:
        check_rows(x, 2, "input")
    assert words in str(err.value) and not NUMPY_WORDS.search(str(err.value)), err.value


def test_spec_errors_name_the_config():
    with pytest.raises(SpecError) as err:
        MLPSpec.from_json("{nope")
    assert str(err.value).startswith("spec: the model config is not valid JSON")
