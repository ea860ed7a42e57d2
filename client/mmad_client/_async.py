"""The asyncio client, :class:`AsyncClient`: :class:`mmad_client.Client`'s methods as coroutines."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Mapping

import httpx
import numpy as np
import tenacity

from ._base import (
    DEFAULT_BASE_URL, DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT, EVENT_STREAM_RECONNECTS, BaseClient, Call,
    DatasetUpload, JobFollower, ProgressCallback, train_upload_progress,
)
from ._retry import DEFAULT_RETRY, Retry
from .errors import MMADClientError, status_error, transport_error


class AsyncClient(BaseClient):
    """asyncio client for an mmad daemon; the same methods as :class:`mmad_client.Client`,
    awaited. ``transport`` is an ``httpx.AsyncBaseTransport``. Use ``async with`` or
    ``await client.aclose()``.
    """

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, api_key: str | None = None,
                 timeout: httpx.Timeout | float | None = DEFAULT_TIMEOUT,
                 transport: httpx.AsyncBaseTransport | None = None,
                 headers: Mapping[str, str] | None = None, retry: Retry | None = DEFAULT_RETRY) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout, headers=headers, retry=retry)
        self._http = httpx.AsyncClient(transport=transport, **self._http_options())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    # the wait between tries (tests put a recorder here instead of waiting)
    _sleep = staticmethod(asyncio.sleep)

    async def _send(self, call: Call) -> Any:
        retry = self._retry_options(call)
        if retry is None:
            return await self._send_once(call)
        return await tenacity.AsyncRetrying(sleep=self._sleep, **retry)(self._send_once, call)

    async def _send_once(self, call: Call) -> Any:
        try:
            response = await self._http.request(call.method, call.path, content=call.content,
                                                headers=call.headers, params=call.params)
        except httpx.TransportError as exc:
            raise transport_error(exc) from exc
        return call.finish(response)

    # -- health and metadata ----------------------------------------------------------------
    async def health_live(self) -> bool:
        """True when the daemon answers ``GET /v2/health/live`` with 200; :class:`TransportError`
        when nothing answers."""
        return await self._send(self._health_live())

    async def health_ready(self) -> bool:
        """True when the daemon is ready to serve (``GET /v2/health/ready`` is 200)."""
        return await self._send(self._health_ready())

    async def server_metadata(self) -> dict:
        """``{"name", "version", "extensions"}`` from ``GET /v2``."""
        return await self._send(self._server_metadata())

    async def model_metadata(self, name: str, version: str | int | None = None) -> dict:
        """The model's ``name``, ``versions``, ``platform``, ``inputs`` and ``outputs``."""
        return await self._send(self._model_metadata(name, version))

    async def model_ready(self, name: str, version: str | int | None = None) -> bool:
        """True when the model (or version) can serve; raises :class:`NotFound` for an unknown one."""
        return await self._send(self._model_ready(name, version))

    # -- models ---------------------------------------------------------------------------
    async def create_model(self, name: str, spec: Mapping[str, Any],
                           config: Mapping[str, Any] | None = None) -> dict:
        """Create or replace ``name`` from a tiny-cuda-nn JSON spec; returns the model metadata.

        ``config`` may hold ``max_batch_rows``, ``max_queue_delay_us``, ``max_queue_requests``,
        ``allow_nonfinite``.
        """
        return await self._send(self._create_model(name, spec, config))

    async def delete_model(self, name: str) -> None:
        """Delete the model and all its versions."""
        await self._send(self._delete_model(name))

    # -- inference and training steps -----------------------------------------------------
    async def infer(self, name: str, x: Any, version: str | int | None = None, *, binary: bool = True,
                    output_dtype: Any = np.float32) -> np.ndarray:
        """Run the model on ``x`` ``[rows, n_input_dims]``; returns ``[rows, n_output_dims]``.

        Binary tensors by default (FP16 on the wire when ``x`` is float16, FP32 otherwise);
        ``binary=False`` sends JSON. ``output_dtype`` is float32 or float16 (binary only).
        The result is a read-only view of the response body when no conversion was needed.
        """
        return await self._send(self._infer(name, x, version, binary, output_dtype))

    async def train_step(self, name: str, x: Any, y: Any, steps: int = 1, *, binary: bool = True) -> np.ndarray:
        """Run ``steps`` optimizer steps on the batch ``(x, y)``; returns the loss of each step."""
        return await self._send(self._train_step(name, x, y, steps, binary))

    async def train(self, name: str, x: Any, y: Any, steps: int, batch_size: int,
                    checkpoint_every: int | None = None, progress: bool | ProgressCallback = True) -> dict:
        """Train on a dataset: upload ``(x, y)``, start a job, follow its progress, return its
        final status (``state`` done or cancelled, ``step``, ``loss``, ``versions``, ...).

        ``progress``: True shows a bar (tqdm if installed, else a stderr line), False shows
        nothing, a callable ``progress(event, data)`` gets every Server-Sent Event. With True,
        an upload of more than one chunk also shows its bytes (:meth:`upload_dataset`'s
        ``progress=None``); otherwise the upload shows nothing.
        Raises :class:`JobFailed` when the job fails. Cancelling the task cancels the job on the server.
        """
        dataset = await self.upload_dataset(name, x, y, progress=train_upload_progress(progress))
        job = await self.start_job(name, dataset, steps, batch_size, checkpoint_every)
        return await self.follow_job(name, job, progress, cancel_on_interrupt=True)

    async def upload_dataset(self, name: str, x: Any, y: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
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
        upload.plan(await self._send(self._dataset_limits(name)))
        dataset: str | None = None
        try:
            upload.start()
            rows = 0
            for body in upload.bodies():
                dataset, rows = await self._send(self._add_dataset_chunk(name, dataset, body))
                upload.sent(len(body))
            upload.check_rows(dataset, rows)
        except BaseException:
            if dataset is not None:
                await self._delete_dataset_quietly(name, dataset)
            raise
        finally:
            upload.close()
        return dataset

    async def _delete_dataset_quietly(self, name: str, dataset: str) -> None:
        try:
            await self.delete_dataset(name, dataset)
        except MMADClientError:
            pass  # the upload's own error is what the caller must see

    async def list_datasets(self, name: str) -> list[dict]:
        """The model's datasets: ``[{"dataset", "rows", "bytes", "x_dtype", "y_dtype", "chunks",
        "on_device"}, ...]``."""
        return await self._send(self._list_datasets(name))

    async def delete_dataset(self, name: str, dataset: str) -> None:
        """Delete a dataset (a job training from it keeps going with the copy it holds)."""
        await self._send(self._delete_dataset(name, dataset))

    async def start_job(self, name: str, dataset: str, steps: int, batch_size: int,
                        checkpoint_every: int | None = None, seed: int | None = None) -> str:
        """Start a training job over an uploaded dataset; returns the job id. ``seed`` fixes the
        epochs' order of the dataset's rows (random when None; the job's status reports it)."""
        return await self._send(self._start_job(name, dataset, steps, batch_size, checkpoint_every, seed))

    async def follow_job(self, name: str, job: str, progress: bool | ProgressCallback = True, *,
                         cancel_on_interrupt: bool = False) -> dict:
        """Follow a job's events until it ends (see :meth:`train` for ``progress``); returns its
        final status, raises :class:`JobFailed` when it failed. With ``cancel_on_interrupt``,
        an interrupt while following cancels the job on the server first."""
        follower = JobFollower(name, job, progress)
        try:
            for _ in range(EVENT_STREAM_RECONNECTS):
                async with contextlib.aclosing(self._event_lines(name, job)) as lines:
                    async for line in lines:
                        if follower.feed_line(line):
                            break
                # the stream can also end early (proxy, restart): ask the job itself
                if follower.final is not None or follower.take_status(await self.job_status(name, job)):
                    break
        except (KeyboardInterrupt, asyncio.CancelledError):
            if cancel_on_interrupt:
                await self._cancel_quietly(name, job)
            raise
        finally:
            follower.close()
        return follower.result()

    async def _event_lines(self, name: str, job: str) -> AsyncIterator[str]:
        path, headers, timeout = self._job_events(name, job)
        try:
            async with self._http.stream("GET", path, headers=headers, timeout=timeout) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise status_error(response)
                async for line in response.aiter_lines():
                    yield line
        except httpx.TransportError as exc:
            raise transport_error(exc) from exc

    async def _cancel_quietly(self, name: str, job: str) -> None:
        try:
            await self.cancel_job(name, job)
        except MMADClientError:
            pass  # the interrupt is what the caller must see

    async def job_status(self, name: str, job: str) -> dict:
        """``{"job", "state", "step", "steps", "loss", "samples_per_s", "versions", "error"}``."""
        return await self._send(self._job_status(name, job))

    async def cancel_job(self, name: str, job: str) -> dict:
        """Cancel a training job; returns the server's answer."""
        return await self._send(self._cancel_job(name, job))

    # -- weights and versions -------------------------------------------------------------
    async def get_weights(self, name: str, version: str | int | None = None) -> dict[str, np.ndarray]:
        """The parameters ``{"W0", "b0", ...}`` (fp32, ``W`` is ``[fan_out, fan_in]``) of the
        latest or a given version."""
        return await self._send(self._get_weights(name, version))

    async def set_weights(self, name: str, weights: Mapping[str, Any]) -> str:
        """Upload a full parameter set (sent as fp32 safetensors); returns the new version."""
        return await self._send(self._set_weights(name, weights))

    async def versions(self, name: str) -> dict:
        """``{"versions": [{"version", "step", "created", "sha256"}, ...], "latest"}``."""
        return await self._send(self._versions(name))

    async def checkpoint(self, name: str) -> str:
        """Save the current weights as a new version; returns it."""
        return await self._send(self._checkpoint(name))

    # -- repository, statistics, devices --------------------------------------------------
    async def repository_index(self) -> list:
        """Every model in the store with its state (Triton repository index)."""
        return await self._send(self._repository_index())

    async def load(self, name: str) -> None:
        """Load a model from the store (repository extension)."""
        await self._send(self._load(name))

    async def unload(self, name: str) -> None:
        """Unload a model, freeing its device memory; it stays in the store."""
        await self._send(self._unload(name))

    async def stats(self, name: str) -> dict:
        """Triton statistics: ``{"model_stats": [{"inference_count", "inference_stats", ...}]}``."""
        return await self._send(self._stats(name))

    async def devices(self) -> dict:
        """The probe report ``{"selected", "rows"}``."""
        return await self._send(self._devices())

    async def metrics(self) -> str:
        """The Prometheus metrics text."""
        return await self._send(self._metrics())
