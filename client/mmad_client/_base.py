"""What :class:`Client` and :class:`AsyncClient` share: settings, request building, response
parsing, the Server-Sent Events parser and the training progress display.

Each API call is built here as a :class:`Call` (method, path, body, headers, and the function
that turns the ``httpx.Response`` into the Python result); the two clients only differ in how
they send it (blocking or awaited), so every endpoint's wire format lives in one place.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping
from urllib.parse import quote

import httpx
import numpy as np

from . import _binary
from ._retry import DEFAULT_RETRY, Retry
from .errors import JobFailed, ProtocolError, status_error

__version__ = "0.1.0"

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# inference on 65k-row batches and training steps can take seconds; connecting should not
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
JOB_STATES_FINAL = ("done", "cancelled", "failed")
EVENT_STREAM_RECONNECTS = 3

ProgressCallback = Callable[[str, dict], None]


@dataclass
class Call:
    """One HTTP exchange: what to send and how to read the answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], Any]
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] | None = None
    # health and readiness answer "no" with a status code instead of an error
    raise_for_status: bool = True
    # sending it twice leaves the server as sending it once: the client's Retry may repeat it
    idempotent: bool = False

    def finish(self, response: httpx.Response) -> Any:
        if self.raise_for_status and response.status_code >= 400:
            raise status_error(response)
        return self.parse(response)


def _json_body(doc: Any) -> tuple[bytes, dict[str, str]]:
    try:
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as exc:
        raise ValueError(f"{exc}: JSON cannot carry NaN or Inf (tensors can, as binary=True)") from exc
    return body, {"Content-Type": "application/json"}


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError as exc:
        raise ProtocolError(f"{response.request.method} {response.request.url.path} answered "
                            f"{response.status_code} with a body that is not JSON: {response.text[:200]!r}") from exc


def _field(response: httpx.Response, key: str) -> Any:
    doc = _json(response)
    if not isinstance(doc, dict) or key not in doc:
        raise ProtocolError(f"{response.request.method} {response.request.url.path}: the answer has no "
                            f"{key!r}: {str(doc)[:200]}")
    return doc[key]


def _nothing(response: httpx.Response) -> None:
    return None


def _segment(value: str | int) -> str:
    # model names are validated by the server; quoting keeps a bad one from becoming a path
    return quote(str(value), safe="")


def model_path(name: str, version: str | int | None = None) -> str:
    path = f"/v2/models/{_segment(name)}"
    return path if version is None else f"{path}/versions/{_segment(version)}"


def as_tensor(x: Any, what: str) -> np.ndarray:
    """A 2-D FP32 or FP16 array: float16 stays FP16 on the wire, anything numeric becomes float32."""
    array = np.asarray(x)
    if array.ndim != 2:
        raise ValueError(f"{what} must be 2-D [rows, dims]; got shape {array.shape}")
    if array.dtype == np.float16 or array.dtype == np.float32:
        return array
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{what} must be numeric; got dtype {array.dtype}")
    return array.astype(np.float32)


def _output_datatype(output_dtype: Any) -> str:
    dtype = np.dtype(output_dtype)
    if dtype == np.float32:
        return "FP32"
    if dtype == np.float16:
        return "FP16"
    raise ValueError(f"output_dtype must be float32 or float16; got {dtype}")


def _tensor_request(inputs: dict[str, np.ndarray], binary: bool, extra: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """Body and headers of an OIP request carrying ``inputs`` (JSON or binary extension)."""
    entries = []
    for name, array in inputs.items():
        entry: dict[str, Any] = {"name": name, "shape": list(array.shape), "datatype": _binary.oip_datatype(array)}
        if not binary:
            if array.dtype == np.float16:
                raise ValueError(f"{name} is float16, which the protocol carries only as binary data: "
                                 "use binary=True or pass float32")
            entry["data"] = array.ravel().tolist()
        entries.append(entry)
    header = {"inputs": entries, **extra}
    if not binary:
        return _json_body(header)
    body, header_length = _binary.encode_binary_request(header, list(inputs.values()))
    return body, {"Content-Type": "application/octet-stream",
                  "Inference-Header-Content-Length": str(header_length)}


def _infer_output(output_dtype: np.dtype) -> Callable[[httpx.Response], np.ndarray]:
    def parse(response: httpx.Response) -> np.ndarray:
        length = response.headers.get("inference-header-content-length")
        try:
            header_length = None if length is None else int(length)
        except ValueError as exc:
            raise ProtocolError(f"Inference-Header-Content-Length is not an integer: {length!r}") from exc
        _, outputs = _binary.decode_infer_response(response.content, header_length)
        if "OUTPUT" not in outputs:
            raise ProtocolError(f"the inference response has no OUTPUT tensor; it has {sorted(outputs)}")
        out = outputs["OUTPUT"]
        # a zero-copy view of the body when the server already sent the requested dtype
        return out if out.dtype == output_dtype else out.astype(output_dtype)
    return parse


def _losses(response: httpx.Response) -> np.ndarray:
    return np.asarray(_field(response, "losses"), dtype=np.float64)


def _weights(response: httpx.Response) -> dict[str, np.ndarray]:
    return _binary.decode_safetensors(response.content, copy=True)


def _dataset_answer(response: httpx.Response) -> tuple[str, int]:
    """(dataset id, rows it holds now) from a chunk upload's answer."""
    dataset, rows = _field(response, "dataset"), _field(response, "rows")
    if not isinstance(dataset, str) or isinstance(rows, bool) or not isinstance(rows, int):
        raise ProtocolError(f"POST {response.request.url.path}: the answer's dataset and rows are "
                            f"{dataset!r} and {rows!r}")
    return dataset, rows


def _is_ok(response: httpx.Response) -> bool:
    return response.status_code == 200


def _model_ready(response: httpx.Response) -> bool:
    # OIP: 200 means ready, a 4xx/503 means not; an unknown model is an error, not "not ready"
    if response.status_code == 404:
        raise status_error(response)
    if response.status_code != 200:
        return False
    try:
        doc = response.json()
    except ValueError:
        return True
    return bool(doc.get("ready", True)) if isinstance(doc, dict) else True


class BaseClient:
    """Settings and request building shared by :class:`Client` and :class:`AsyncClient`."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, api_key: str | None = None,
                 timeout: httpx.Timeout | float | None = DEFAULT_TIMEOUT,
                 headers: Mapping[str, str] | None = None, retry: Retry | None = DEFAULT_RETRY) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        if retry is not None and not isinstance(retry, Retry):
            raise TypeError(f"retry must be a mmad_client.Retry or None; got {type(retry).__name__}")
        self.retry = retry
        # identity: the daemon compresses responses when asked (as Triton does), and httpx asks by
        # default; tensors barely compress, so that would cost the daemon CPU per request for nothing
        self._headers = {"User-Agent": f"mmad-client/{__version__}", "Accept-Encoding": "identity",
                         **(headers or {})}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def _retry_options(self, call: Call) -> dict[str, Any] | None:
        """tenacity's arguments when ``call`` may be tried again, else None (sent once)."""
        if self.retry is None or not self.retry.applies(call.idempotent):
            return None
        return self.retry.tenacity_options(call.method, call.path)

    def _http_options(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "headers": self._headers, "timeout": self.timeout}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    # -- health and metadata ----------------------------------------------------------------
    def _health_live(self) -> Call:
        return Call("GET", "/v2/health/live", _is_ok, raise_for_status=False, idempotent=True)

    def _health_ready(self) -> Call:
        return Call("GET", "/v2/health/ready", _is_ok, raise_for_status=False, idempotent=True)

    def _server_metadata(self) -> Call:
        return Call("GET", "/v2", _json, idempotent=True)

    def _model_metadata(self, name: str, version: str | int | None) -> Call:
        return Call("GET", model_path(name, version), _json, idempotent=True)

    def _model_ready(self, name: str, version: str | int | None) -> Call:
        return Call("GET", f"{model_path(name, version)}/ready", _model_ready, raise_for_status=False,
                    idempotent=True)

    # -- models ---------------------------------------------------------------------------
    def _create_model(self, name: str, spec: Any, config: Mapping[str, Any] | None) -> Call:
        if hasattr(spec, "to_json"):  # an mmad.spec.MLPSpec, without importing mmad
            spec = spec.to_json()
        if not isinstance(spec, Mapping):
            raise TypeError(f"spec must be a dict (tiny-cuda-nn JSON); got {type(spec).__name__}")
        doc: dict[str, Any] = {"spec": dict(spec)}
        if config is not None:
            doc["config"] = dict(config)
        body, headers = _json_body(doc)
        return Call("PUT", model_path(name), _json, body, headers)

    def _delete_model(self, name: str) -> Call:
        return Call("DELETE", model_path(name), _nothing)

    # -- inference and training steps -----------------------------------------------------
    def _infer(self, name: str, x: Any, version: str | int | None, binary: bool, output_dtype: Any) -> Call:
        array = as_tensor(x, "x")
        out_datatype = _output_datatype(output_dtype)
        if out_datatype == "FP16" and not binary:
            raise ValueError("FP16 outputs exist only as binary data: use binary=True or output_dtype=float32")
        output: dict[str, Any] = {"name": "OUTPUT", "parameters": {"binary_data": binary}}
        extra: dict[str, Any] = {"outputs": [output]}
        if binary:
            extra["parameters"] = {"binary_data_output": True}
        if out_datatype == "FP16":
            # api.md names ``parameters.output_datatype`` without saying whose parameters: the
            # request's (KServe request parameters) and the output's (Triton's per-output options)
            output["parameters"]["output_datatype"] = "FP16"
            extra["parameters"]["output_datatype"] = "FP16"
        body, headers = _tensor_request({"INPUT": array}, binary, extra)
        return Call("POST", f"{model_path(name, version)}/infer", _infer_output(np.dtype(output_dtype)),
                    body, headers, idempotent=True)

    def _train_step(self, name: str, x: Any, y: Any, steps: int, binary: bool) -> Call:
        inputs = {"INPUT": as_tensor(x, "x"), "TARGET": as_tensor(y, "y")}
        if inputs["INPUT"].shape[0] != inputs["TARGET"].shape[0]:
            raise ValueError(f"x has {inputs['INPUT'].shape[0]} rows but y has {inputs['TARGET'].shape[0]}")
        body, headers = _tensor_request(inputs, binary, {"parameters": {"steps": int(steps)}})
        return Call("POST", f"{model_path(name)}/train", _losses, body, headers)

    # -- weights and versions -------------------------------------------------------------
    def _get_weights(self, name: str, version: str | int | None) -> Call:
        params = None if version is None else {"version": str(version)}
        return Call("GET", f"{model_path(name)}/weights", _weights, params=params, idempotent=True)

    def _set_weights(self, name: str, weights: Mapping[str, Any]) -> Call:
        tensors = {k: np.asarray(v, dtype=np.float32, order="C") for k, v in weights.items()}
        return Call("PUT", f"{model_path(name)}/weights", lambda r: str(_field(r, "version")),
                    _binary.encode_safetensors(tensors), {"Content-Type": "application/octet-stream"})

    def _versions(self, name: str) -> Call:
        return Call("GET", f"{model_path(name)}/versions", _json, idempotent=True)

    def _checkpoint(self, name: str) -> Call:
        return Call("POST", f"{model_path(name)}/versions", lambda r: str(_field(r, "version")))

    # -- repository, statistics, devices --------------------------------------------------
    def _repository_index(self) -> Call:
        body, headers = _json_body({})
        return Call("POST", "/v2/repository/index", _json, body, headers, idempotent=True)

    def _load(self, name: str) -> Call:
        body, headers = _json_body({})
        return Call("POST", f"/v2/repository/models/{_segment(name)}/load", _nothing, body, headers,
                    idempotent=True)

    def _unload(self, name: str) -> Call:
        body, headers = _json_body({})
        return Call("POST", f"/v2/repository/models/{_segment(name)}/unload", _nothing, body, headers,
                    idempotent=True)

    def _stats(self, name: str) -> Call:
        return Call("GET", f"{model_path(name)}/stats", _json, idempotent=True)

    def _devices(self) -> Call:
        return Call("GET", "/v2/devices", _json, idempotent=True)

    def _metrics(self) -> Call:
        return Call("GET", "/metrics", lambda r: r.text, idempotent=True)

    # -- datasets -------------------------------------------------------------------------
    def _list_datasets(self, name: str) -> Call:
        return Call("GET", f"{model_path(name)}/datasets", lambda r: list(_field(r, "datasets")), idempotent=True)

    def _dataset_limits(self, name: str) -> Call:
        """(bytes of one chunk, bytes of one dataset) the server takes, from its dataset listing."""
        def parse(response: httpx.Response) -> tuple[int | None, int | None]:
            doc = _json(response)
            if not isinstance(doc, dict):
                raise ProtocolError(f"GET {response.request.url.path}: the answer is not a JSON object")
            return doc.get("max_chunk_bytes"), doc.get("max_dataset_bytes")
        return Call("GET", f"{model_path(name)}/datasets", parse, idempotent=True)

    def _add_dataset_chunk(self, name: str, dataset: str | None, body: bytes) -> Call:
        """The first chunk creates the dataset (``dataset`` None), the others are appended to it."""
        path = f"{model_path(name)}/datasets" + ("" if dataset is None else f"/{_segment(dataset)}/chunks")
        return Call("POST", path, _dataset_answer, body, {"Content-Type": "application/octet-stream"})

    def _delete_dataset(self, name: str, dataset: str) -> Call:
        return Call("DELETE", f"{model_path(name)}/datasets/{_segment(dataset)}", _nothing)

    # -- training jobs --------------------------------------------------------------------

    def _start_job(self, name: str, dataset: str, steps: int, batch_size: int, checkpoint_every: int | None,
                   seed: int | None = None) -> Call:
        doc: dict[str, Any] = {"dataset": dataset, "steps": int(steps), "batch_size": int(batch_size)}
        if checkpoint_every is not None:
            doc["checkpoint_every"] = int(checkpoint_every)
        if seed is not None:
            doc["seed"] = int(seed)
        body, headers = _json_body(doc)
        return Call("POST", f"{model_path(name)}/jobs", lambda r: str(_field(r, "job")), body, headers)

    def _job_status(self, name: str, job: str) -> Call:
        return Call("GET", f"{model_path(name)}/jobs/{_segment(job)}", _json, idempotent=True)

    def _cancel_job(self, name: str, job: str) -> Call:
        return Call("DELETE", f"{model_path(name)}/jobs/{_segment(job)}", _json)

    def _job_events(self, name: str, job: str) -> tuple[str, dict[str, str], httpx.Timeout]:
        # events arrive as steps finish; a slow step must not look like a dead connection
        timeout = httpx.Timeout(self.timeout.connect, connect=self.timeout.connect, read=None)
        return (f"{model_path(name)}/jobs/{_segment(job)}/events", {"Accept": "text/event-stream"}, timeout)


DEFAULT_CHUNK_BYTES = 32 * 1024 * 1024
PROGRESS_EXTRA = "pip install 'mmad-client[progress]'"


def _sizes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _tqdm() -> Any:
    """tqdm's class, or None when it is not installed (an optional extra: ``progress``)."""
    try:
        from tqdm.auto import tqdm  # optional: never a dependency
    except ImportError:
        return None
    return tqdm


class DatasetUpload:
    """One dataset upload in chunks, shared by both clients: the arrays' types and the split into
    row ranges whose safetensors encodings stay within ``chunk_bytes`` and the server's body
    limit, the bodies one at a time (never more than one chunk's copy), and the progress bar.

    ``x`` and ``y`` keep float16 as float16 and float32 as float32; anything else numeric
    (float64, integers) goes as float32. ``progress``: True draws a tqdm bar of the bytes sent
    (an ImportError naming the ``progress`` extra when tqdm is missing), False none, None one
    when the upload takes more than one chunk, stderr is a terminal and tqdm is installed.
    """

    def __init__(self, name: str, x: Any, y: Any, chunk_bytes: int, progress: bool | None) -> None:
        self.name = name
        self.x = self._array(x, "x")
        self.y = self._array(y, "y")
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"x has {self.x.shape[0]} rows but y has {self.y.shape[0]}")
        if self.x.shape[0] == 0:
            raise ValueError("a dataset needs at least one row; x and y have none")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive integer; got {chunk_bytes!r}")
        if progress not in (True, False, None):
            raise TypeError(f"progress must be True, False or None; got {progress!r}")
        self.chunk_bytes = chunk_bytes
        self.progress = progress
        self._tqdm = _tqdm() if progress is not False else None
        if progress is True and self._tqdm is None:
            raise ImportError(f"progress=True draws the upload's progress with tqdm, which is not installed: "
                              f"{PROGRESS_EXTRA} (or pass progress=False)")
        self.ranges: list[tuple[int, int]] = []
        self.total = 0
        self._bar: Any = None

    @staticmethod
    def _array(a: Any, what: str) -> np.ndarray:
        array = as_tensor(a, what)  # 2-D; float16 and float32 as they are, other numbers as float32
        return array if array.dtype in (np.float16, np.float32) else array.astype(np.float32)

    def plan(self, limits: tuple[int | None, int | None]) -> None:
        """Split the rows for the server's ``(max chunk bytes, max dataset bytes)`` (None: unknown)."""
        max_chunk, max_dataset = limits
        limit = min(self.chunk_bytes, max_chunk) if isinstance(max_chunk, int) and max_chunk > 0 else self.chunk_bytes
        rows = self.x.shape[0]
        # the header of the whole arrays is the longest any chunk's can be (its numbers are the largest)
        fixed = _binary.safetensors_size({"x": self.x, "y": self.y}) - self.x.nbytes - self.y.nbytes
        row_bytes = self.x.nbytes // rows + self.y.nbytes // rows
        per_chunk = (limit - fixed) // row_bytes
        if per_chunk < 1:
            which = "chunk_bytes" if limit == self.chunk_bytes else "the server's body limit"
            raise ValueError(f"{which} ({limit} bytes) cannot hold one row: a row is {row_bytes} bytes and a "
                             f"chunk's header up to {fixed}")
        self.ranges = [(a, min(a + per_chunk, rows)) for a in range(0, rows, per_chunk)]
        self.total = sum(self._size(a, b) for a, b in self.ranges)
        if isinstance(max_dataset, int) and self.total > max_dataset:
            would, limit = _sizes(self.total), _sizes(max_dataset)
            if would == limit:
                would, limit = f"{would} ({self.total} bytes)", f"{limit} ({max_dataset} bytes)"
            raise ValueError(f"the dataset would hold {would} on the server; its limit (--max-dataset-bytes) "
                             f"is {limit}")

    def _size(self, a: int, b: int) -> int:
        return _binary.safetensors_size({"x": self.x[a:b], "y": self.y[a:b]})

    def bodies(self) -> Iterator[bytes]:
        """Each chunk's safetensors body, made when it is about to be sent."""
        for a, b in self.ranges:
            yield _binary.encode_safetensors({"x": self.x[a:b], "y": self.y[a:b]})

    def start(self) -> None:
        show = self.progress is True or (self.progress is None and len(self.ranges) > 1 and self._tqdm is not None
                                          and sys.stderr.isatty())
        if show:
            self._bar = self._tqdm(total=self.total, desc=f"upload {self.name}", unit="B", unit_scale=True,
                                   unit_divisor=1024, file=sys.stderr)

    def sent(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)

    def check_rows(self, dataset: str, rows: int) -> None:
        if rows != self.x.shape[0]:
            raise ProtocolError(f"dataset {dataset}: the server holds {rows} rows after the last chunk; "
                                f"{self.x.shape[0]} were sent")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def train_upload_progress(progress: bool | ProgressCallback) -> bool | None:
    """The upload's ``progress`` in :meth:`train`: its own bar where the job's shows (when tqdm is
    installed and stderr is a terminal, for more than one chunk), none otherwise."""
    return None if progress is True else False


@dataclass
class Event:
    """One Server-Sent Event."""

    event: str
    data: str


class SSEParser:
    """Incremental ``text/event-stream`` parser (WHATWG HTML "Server-sent events" 9.2.6), fed
    one line at a time without its terminator."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> Event | None:
        if line == "":
            event = Event(self._event or "message", "\n".join(self._data)) if self._data else None
            self._event, self._data = "", []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None  # "id" and "retry" do not matter to a client that reconnects itself


class _StderrBar:
    """Progress on one stderr line, for when tqdm is not installed."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc = total, desc
        self._shown = 0.0
        self._line = ""

    def show(self, step: int, postfix: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._shown >= 0.1:
            self._shown = now
            line = f"{self.desc}: {step}/{self.total} steps {postfix}"
            # blank out what is left of a longer previous line
            sys.stderr.write(f"\r{line}{' ' * max(0, len(self._line) - len(line))}")
            self._line = line
            sys.stderr.flush()

    def close(self) -> None:
        if self._line:
            sys.stderr.write("\n")
            sys.stderr.flush()


class _TqdmBar:
    def __init__(self, tqdm: Any, total: int, desc: str) -> None:
        self._bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr)

    def show(self, step: int, postfix: str, force: bool = False) -> None:
        self._bar.update(max(0, step - self._bar.n))
        self._bar.set_postfix_str(postfix, refresh=force)

    def close(self) -> None:
        self._bar.close()


def _progress_bar(total: int, desc: str) -> _StderrBar | _TqdmBar:
    tqdm = _tqdm()
    return _StderrBar(total, desc) if tqdm is None else _TqdmBar(tqdm, total, desc)


class JobFollower:
    """Consumes a job's event stream: shows progress and keeps the final status.

    ``progress``: True (tqdm when importable, else a stderr line), False (silent), or a
    callable ``progress(event_name, data)`` called for every event.
    """

    def __init__(self, name: str, job: str, progress: bool | ProgressCallback) -> None:
        self.name = name
        self.job = job
        self.final: dict[str, Any] | None = None
        self._callback = progress if callable(progress) else None
        self._show_bar = progress is True
        self._bar: _StderrBar | _TqdmBar | None = None  # made when the first event gives the total
        self._parser = SSEParser()

    def feed_line(self, line: str) -> bool:
        """Feed one line of the stream; True once the job's final event has arrived."""
        event = self._parser.feed(line)
        if event is None:
            return False
        try:
            data = json.loads(event.data) if event.data else {}
        except ValueError as exc:
            raise ProtocolError(f"job {self.job}: event {event.event!r} data is not JSON: "
                                f"{event.data[:200]!r}") from exc
        if self._callback is not None:
            self._callback(event.event, data)
        if event.event == "progress":
            self._show(data)
        elif event.event in JOB_STATES_FINAL:
            self.take_status(data)
        return self.final is not None

    def take_status(self, status: dict[str, Any]) -> bool:
        """Use a polled job status; True when it is final."""
        if status.get("state") in JOB_STATES_FINAL:
            self.final = status
            self._show(status, force=True)
        return self.final is not None

    def _show(self, data: dict[str, Any], force: bool = False) -> None:
        if not self._show_bar or "step" not in data:
            return
        if self._bar is None:
            self._bar = _progress_bar(int(data.get("steps") or data["step"]), f"train {self.name}")
        parts = []
        if data.get("loss") is not None:
            parts.append(f"loss {data['loss']:.4g}")
        if data.get("samples_per_s") is not None:
            parts.append(f"{data['samples_per_s']:,.0f} samples/s")
        self._bar.show(int(data["step"]), ", ".join(parts), force)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar, self._show_bar = None, False

    def result(self) -> dict[str, Any]:
        if self.final is None:
            raise ProtocolError(f"job {self.job}: the event stream ended {EVENT_STREAM_RECONNECTS} times "
                                "before the job finished")
        if self.final.get("state") == "failed":
            raise JobFailed(self.final)
        return self.final
