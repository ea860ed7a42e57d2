"""The blocking client, :class:`Client`."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Mapping

import httpx
import numpy as np
import tenacity

from ._base import (
    DEFAULT_BASE_URL, DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT, EVENT_STREAM_RECONNECTS, BaseClient, Call,
    DatasetUpload, JobFollower, ProgressCallback, train_upload_progress,
)
from ._retry import DEFAULT_RETRY, Retry
from .errors import MMADClientError, status_error, transport_error


class Client(BaseClient):
    """Blocking client for an mmad daemon (Open Inference Protocol v2 + mmad extensions).

    ``Client(base_url, api_key=None, timeout=Timeout(60, connect=5), transport=None, retry=Retry())``;
    ``transport`` is any ``httpx.BaseTransport`` (e.g. ``httpx.MockTransport`` in tests);
    ``retry`` (:class:`Retry`) says which calls are tried again after a dropped connection or a
    503, and how long to wait; ``None`` sends every call once.
    Use it as a context manager, or call :meth:`close`. Errors are :mod:`mmad_client.errors`.
    """

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, api_key: str | None = None,
                 timeout: httpx.Timeout | float | None = DEFAULT_TIMEOUT,
                 transport: httpx.BaseTransport | None = None,
                 headers: Mapping[str, str] | None = None, retry: Retry | None = DEFAULT_RETRY) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout, headers=headers, retry=retry)
        self._http = httpx.Client(transport=transport, **self._http_options())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # the wait between tries (tests put a recorder here instead of waiting)
    _sleep = staticmethod(time.sleep)

    def _send(self, call: Call) -> Any:
        retry = self._retry_options(call)
        if retry is None:
            return self._send_once(call)
        return tenacity.Retrying(sleep=self._sleep, **retry)(self._send_once, call)

    def _send_once(self, call: Call) -> Any:
        try:
            response = self._http.request(call.method, call.path, content=call.content,
                                          headers=call.headers, params=call.params)
        except httpx.TransportError as exc:
            raise transport_error(exc) from exc
        return call.finish(response)

    # -- health and metadata ----------------------------------------------------------------
    def health_live(self) -> bool:
        """True when the daemon answers ``GET /v2/health/live`` with 200; :class:`TransportError`
        when nothing answers."""
        return self._send(self._health_live())

    def health_ready(self) -> bool:
        """True when the daemon is ready to serve (``GET /v2/health/ready`` is 200)."""
        return self._send(self._health_ready())

    def server_metadata(self) -> dict:
        """``{"name", "version", "extensions"}`` from ``GET /v2``."""
        return self._send(self._server_metadata())

    def model_metadata(self, name: str, version: str | int | None = None) -> dict:
        """The model's ``name``, ``versions``, ``platform``, ``inputs`` and ``outputs``."""
        return self._send(self._model_metadata(name, version))

    def model_ready(self, name: str, version: str | int | None = None) -> bool:
        """True when the model (or version) can serve; raises :class:`NotFound` for an unknown one."""
        return self._send(self._model_ready(name, version))

    # -- models ---------------------------------------------------------------------------
    def create_model(self, name: str, spec: Mapping[str, Any],
                     config: Mapping[str, Any] | None = None) -> dict:
        """Create or replace ``name`` from a tiny-cuda-nn JSON spec; returns the model metadata.

        ``config`` may hold ``max_batch_rows``, ``max_queue_delay_us``, ``max_queue_requests``,
        ``allow_nonfinite``.
        """
        return self._send(self._create_model(name, spec, config))

    def delete_model(self, name: str) -> None:
        """Delete the model and all its versions."""
        self._send(self._delete_model(name))

    # -- inference and training steps -----------------------------------------------------
    def infer(self, name: str, x: Any, version: str | int | None = None, *, binary: bool = True,
              output_dtype: Any = np.float32) -> np.ndarray:
        """Run the model on ``x`` ``[rows, n_input_dims]``; returns ``[rows, n_output_dims]``.

        Binary tensors by default (FP16 on the wire when ``x`` is float16, FP32 otherwise);
        ``binary=False`` sends JSON. ``output_dtype`` is float32 or float16 (binary only).
        The result is a read-only view of the response body when no conversion was needed.
        """
        return self._send(self._infer(name, x, version, binary, output_dtype))

    def train_step(self, name: str, x: Any, y: Any, steps: int = 1, *, binary: bool = True) -> np.ndarray:
        """Run ``steps`` optimizer steps on the batch ``(x, y)``; returns the loss of each step."""
        return self._send(self._train_step(name, x, y, steps, binary))

    def train(self, name: str, x: Any, y: Any, steps: int, batch_size: int,
              checkpoint_every: int | None = None, progress: bool | ProgressCallback = True) -> dict:
        """Train on a dataset: upload ``(x, y)``, start a job, follow its progress, return its
        final status (``state`` done or cancelled, ``step``, ``loss``, ``versions``, ...).

        ``progress``: True shows a bar (tqdm if installed, else a stderr line), False shows
        nothing, a callable ``progress(event, data)`` gets every Server-Sent Event. With True,
        an upload of more than one chunk also shows its bytes (:meth:`upload_dataset`'s
        ``progress=None``); otherwise the upload shows nothing.
        Raises :class:`JobFailed` when the job fails. Ctrl-C cancels the job on the server.
        """
        dataset = self.upload_dataset(name, x, y, progress=train_upload_progress(progress))
        job = self.start_job(name, dataset, steps, batch_size, checkpoint_every)
        return self.follow_job(name, job, progress, cancel_on_interrupt=True)

    def upload_dataset(self, name: str, x: Any, y: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                       progress: bool | None = None) -> str:
        """Upload a training set ``x`` [rows, n_input_dims], ``y`` [rows, n_output_dims]; returns the
        dataset id.

        The rows go in chunks of at most ``chunk_bytes`` (and the server's body limit) as
        safetensors: the first creates the dataset, the others are appended
        (``POST .../datasets/{id}/chunks``); one chunk's copy is made at a time. float16 arrays
        go as float16, float32 as float32, other numbers as float32. ``progress``: True draws a
        tqdm bar of the bytes (ImportError without tqdm: ``pip install 'mmad-client[progress]'``),
        False nothing, None a bar when there is more than one chunk, stderr is a terminal and tqdm
        is installed. A failure after the first chunk deletes the partial dataset (best effort)
        and raises.
        """
        upload = DatasetUpload(name, x, y, chunk_bytes, progress)
        upload.plan(self._send(self._dataset_limits(name)))
        dataset: str | None = None
        try:
            upload.start()
            rows = 0
            for body in upload.bodies():
                dataset, rows = self._send(self._add_dataset_chunk(name, dataset, body))
                upload.sent(len(body))
            upload.check_rows(dataset, rows)
        except BaseException:
            if dataset is not None:
                self._delete_dataset_quietly(name, dataset)
            raise
        finally:
            upload.close()
        return dataset

    def _delete_dataset_quietly(self, name: str, dataset: str) -> None:
        try:
            self.delete_dataset(name, dataset)
        except MMADClientError:
            pass  # the upload's own error is what the caller must see

    def list_datasets(self, name: str) -> list[dict]:
        """The model's datasets: ``[{"dataset", "rows", "bytes", "x_dtype", "y_dtype", "chunks",
        "on_device"}, ...]``."""
        return self._send(self._list_datasets(name))

    def delete_dataset(self, name: str, dataset: str) -> None:
        """Delete a dataset (a job training from it keeps going with the copy it holds)."""
        self._send(self._delete_dataset(name, dataset))

    def start_job(self, name: str, dataset: str, steps: int, batch_size: int,
                  checkpoint_every: int | None = None, seed: int | None = None) -> str:
        """Start a training job over an uploaded dataset; returns the job id. ``seed`` fixes the
        epochs' order of the dataset's rows (random when None; the job's status reports it)."""
        return self._send(self._start_job(name, dataset, steps, batch_size, checkpoint_every, seed))

    def follow_job(self, name: str, job: str, progress: bool | ProgressCallback = True, *,
                   cancel_on_interrupt: bool = False) -> dict:
        """Follow a job's events until it ends (see :meth:`train` for ``progress``); returns its
        final status, raises :class:`JobFailed` when it failed. With ``cancel_on_interrupt``,
        an interrupt while following cancels the job on the server first."""
        follower = JobFollower(name, job, progress)
        try:
            for _ in range(EVENT_STREAM_RECONNECTS):
                with contextlib.closing(self._event_lines(name, job)) as lines:
                    for line in lines:
                        if follower.feed_line(line):
                            break
                # the stream can also end early (proxy, restart): ask the job itself
                if follower.final is not None or follower.take_status(self.job_status(name, job)):
                    break
        except KeyboardInterrupt:
            if cancel_on_interrupt:
                self._cancel_quietly(name, job)
            raise
        finally:
            follower.close()
        return follower.result()

    def _event_lines(self, name: str, job: str) -> Iterator[str]:
        path, headers, timeout = self._job_events(name, job)
        try:
            with self._http.stream("GET", path, headers=headers, timeout=timeout) as response:
                if response.status_code >= 400:
                    response.read()
                    raise status_error(response)
                yield from response.iter_lines()
        except httpx.TransportError as exc:
            raise transport_error(exc) from exc

    def _cancel_quietly(self, name: str, job: str) -> None:
        try:
            self.cancel_job(name, job)
        except MMADClientError:
            pass  # the interrupt is what the caller must see

    def job_status(self, name: str, job: str) -> dict:
        """``{"job", "state", "step", "steps", "loss", "samples_per_s", "versions", "error"}``."""
        return self._send(self._job_status(name, job))

    def cancel_job(self, name: str, job: str) -> dict:
        """Cancel a training job; returns the server's answer."""
        return self._send(self._cancel_job(name, job))

    # -- weights and versions -------------------------------------------------------------
    def get_weights(self, name: str, version: str | int | None = None) -> dict[str, np.ndarray]:
        """The parameters ``{"W0", "b0", ...}`` (fp32, ``W`` is ``[fan_out, fan_in]``) of the
        latest or a given version."""
        return self._send(self._get_weights(name, version))

    def set_weights(self, name: str, weights: Mapping[str, Any]) -> str:
        """Upload a full parameter set (sent as fp32 safetensors); returns the new version."""
        return self._send(self._set_weights(name, weights))

    def versions(self, name: str) -> dict:
        """``{"versions": [{"version", "step", "created", "sha256"}, ...], "latest"}``."""
        return self._send(self._versions(name))

    def checkpoint(self, name: str) -> str:
        """Save the current weights as a new version; returns it."""
        return self._send(self._checkpoint(name))

    # -- repository, statistics, devices --------------------------------------------------
    def repository_index(self) -> list:
        """Every model in the store with its state (Triton repository index)."""
        return self._send(self._repository_index())

    def load(self, name: str) -> None:
        """Load a model from the store (repository extension)."""
        self._send(self._load(name))

    def unload(self, name: str) -> None:
        """Unload a model, freeing its device memory; it stays in the store."""
        self._send(self._unload(name))

    def stats(self, name: str) -> dict:
        """Triton statistics: ``{"model_stats": [{"inference_count", "inference_stats", ...}]}``."""
        return self._send(self._stats(name))

    def devices(self) -> dict:
        """The probe report ``{"selected", "rows"}``."""
        return self._send(self._devices())

    def metrics(self) -> str:
        """The Prometheus metrics text."""
        return self._send(self._metrics())
