"""Daemon settings: environment variables ``MMAD_*`` (pydantic-settings), overridable from the CLI.

``MMAD_BACKEND`` is the same variable :func:`mmad.backends.select` honours, so a backend forced
for the library is forced for the daemon too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_store_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "mmad" / "store"


class Settings(BaseSettings):
    """Everything ``mmad serve`` can be told; see docs/service.md for the table."""

    model_config = SettingsConfigDict(env_prefix="MMAD_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # the gRPC front end (mmad/grpc/): Triton's GRPCInferenceService on host:grpc_port, as Triton's
    # --grpc-port (8001); served by the primary process, also with --workers
    grpc_port: int = Field(8001, ge=0, le=65535, description="gRPC (KServe v2 / Triton) port; 0: no gRPC")
    store_dir: Path = Field(default_factory=default_store_dir)
    backend: str | None = Field(None, description="cuda|vulkan|wgpu|cpu[:variant]; unset = best available")
    probe: str = Field("all", description="backends listed in /v2/devices: 'all' or a comma list")
    api_key: SecretStr | None = None
    # a file holding the key: unlike --api-key, not readable by other users in /proc/PID/cmdline
    api_key_file: Path | None = None
    # origins besides the daemon's own whose pages may send requests that change something
    # (mmad/server/origin.py): comma-separated scheme://host[:port], or * for every origin
    allow_origin: str = Field("", description="origins whose web pages may call the API, besides the "
                                              "daemon's own: comma-separated scheme://host[:port], or *")
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # one dataset's total size as stored (its chunks, each one request body of at most max_body_bytes)
    max_dataset_bytes: int = Field(16 * 1024 ** 3, ge=1024, description="one dataset's size in the store; "
                                                                       "a chunk past it is answered 413")
    # an infer response's size, the JSON of FP32 outputs counted at JSON_VALUE_BYTES a value: a
    # 61 MiB FP16 request otherwise asked for a 520 MiB JSON response
    max_response_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    # connections (docs/reliability.md, "Connections"): each one costs memory and a descriptor
    # for as long as the client holds it, so idle ones, slow request heads and oversized heads
    # are cut off, and the count is capped below the descriptor limit
    max_connections: int = Field(2048, ge=1, description="open connections; more are answered 503 and closed")
    idle_timeout_s: float = Field(5.0, gt=0, description="a connection with no request in progress is "
                                                         "closed after this (uvicorn's keep-alive timeout)")
    head_timeout_s: float = Field(10.0, gt=0, description="a request line and headers must arrive within this")
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="request line + headers; more is answered 431")
    health_slots: int = Field(16, ge=0, description="connections past max_connections kept for health probes "
                                                    "(one GET /v2/health/live or /ready each)")
    # a request body: docs/reliability.md, "Cross-site requests, slow clients and large headers"
    body_timeout_s: float = Field(10.0, gt=0, description="each window of this long must bring min_body_rate "
                                                          "bytes a second of a request body; else 408 and close")
    min_body_rate: int = Field(16 * 1024, ge=0, description="bytes a second a request body must arrive at "
                                                            "(0: any rate, but a window without a byte is cut)")
    max_pending_body_bytes: int = Field(512 * 1024 * 1024, ge=1024,
                                        description="bytes of request bodies still arriving, all connections "
                                                    "together (at least one body of max_body_bytes); a body "
                                                    "past it is answered 503")
    # dynamic batching defaults; a model's config overrides them
    max_batch_rows: int = Field(65536, ge=1)
    max_queue_delay_us: int = Field(500, ge=0)
    max_queue_requests: int = Field(256, ge=1)
    checkpoint_every: int = Field(100, ge=1, description="default for training jobs")
    compute_threads: int = Field(4, ge=1, description="worker threads that run device work")
    # several processes on one port (mmad/server/workers.py): one event loop bounds serving
    workers: int = Field(0, ge=0, le=64, description="inference worker processes serving the port, the "
                                                     "primary (store, training, admin) behind them; 0: the "
                                                     "primary serves the port itself")
    pinned_body_bytes: int = Field(1 << 30, ge=0, description="page-locked host memory for request and response "
                                                           "bodies on a GPU backend (their device copies skip "
                                                           "staging); 0: ordinary memory")
    forward_threads: int = Field(0, ge=0, description="threads that share the host-side chunks of one large "
                                                      "forward (cpu backend); 0: one per CPU")
    demo: bool = True
    # Triton's --model-repository: one folder per model, loaded at start (mmad/engine/repository.py)
    model_repository: Path | None = Field(None, description="folder of model folders created at start "
                                                            "where the store lacks them (docs/service.md)")
    # Triton's --model-control-mode: none reads the repository once at start; poll follows it
    # read-only (mmad/engine/repository_poll.py)
    model_control_mode: Literal["none", "poll"] = Field(
        "none", description="none: the repository seeds the store at start; poll: the repository is followed "
                            "every repository_poll_secs, read-only (new versions and models served as they appear)")
    repository_poll_secs: float = Field(15.0, gt=0, description="seconds between two passes over the repository "
                                                                "in poll mode")
    log_level: str = "info"
    graceful_timeout_s: float = Field(30.0, ge=0)
    # serving performance: docs/service-performance.md has the measurements behind the defaults
    blas_threads: int = Field(1, ge=0, description="threads of NumPy's BLAS library (0: its own default)")
    loop: Literal["auto", "asyncio", "uvloop"] = Field("auto", description="uvicorn event loop")
    http: Literal["auto", "h11", "httptools"] = Field("auto", description="uvicorn HTTP parser")
    # -- shared memory, the store and held datasets (docs/service.md, "Shared memory: who may
    # register"; docs/reliability.md, "Shared memory, the store and restarts")
    # a registered region is read and written with the daemon's permissions: an admin action
    shared_memory: Literal["off", "loopback", "on"] = Field(
        "loopback", description="who may register shared-memory regions: off (nobody), loopback (clients on "
                                "this host; a keyless daemon: objects of the client's own user only) or on (any "
                                "client with the API key)")
    max_shm_regions: int = Field(256, ge=1, le=65536, description="shared-memory regions registered at once "
                                                                  "(each holds a descriptor); more are 409")
    keep_versions: int = Field(100, ge=0, description="versions kept per model, the newest (a model's config "
                                                      "keep_versions overrides it); 0 keeps all")
    max_host_dataset_bytes: int | None = Field(
        None, ge=1, description="datasets a host-memory backend (cpu) holds for training at once; the least "
                                "recently used go first, one larger is 507; unset: a quarter of the host's memory")

    @field_validator("backend", "api_key", "api_key_file", "model_repository", mode="before")
    @classmethod
    def _empty_is_unset(cls, value):
        return None if value == "" else value

    @field_validator("allow_origin")
    @classmethod
    def _origins_are_origins(cls, value: str) -> str:
        parse_allowed_origins(value)  # a malformed entry stops the start, naming it
        return value

    @field_validator("model_repository")
    @classmethod
    def _repository_is_a_folder(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_dir():  # as Triton: a missing repository stops the start
            raise ValueError(f"model_repository {str(value)!r} is not a folder")
        return value

    @model_validator(mode="after")
    def _poll_needs_a_repository(self):
        if self.model_control_mode == "poll" and self.model_repository is None:
            raise ValueError("model_control_mode 'poll' follows a model repository: give model_repository "
                             "(--model-repository DIR / MMAD_MODEL_REPOSITORY)")
        return self

    @model_validator(mode="after")
    def _key_from_file(self):
        if self.api_key_file is None:
            return self
        if self.api_key is not None:
            raise ValueError("give the API key one way: api_key (MMAD_API_KEY / --api-key) or "
                             "api_key_file (MMAD_API_KEY_FILE / --api-key-file), not both")
        try:
            key = self.api_key_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"api_key_file {str(self.api_key_file)!r} cannot be read: {exc.strerror}") from exc
        if not key:
            raise ValueError(f"api_key_file {str(self.api_key_file)!r} is empty")
        self.api_key = SecretStr(key)
        return self

    @model_validator(mode="after")
    def _shared_memory_on_needs_a_key(self):
        if self.shared_memory == "on" and self.api_key is None:
            raise ValueError("shared_memory 'on' lets any client that reaches the port register shared memory; "
                             "it needs an API key (api_key_file / MMAD_API_KEY_FILE); use 'loopback' without one")
        return self

    @property
    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key is not None else None


# browsers write an Origin without its scheme's default port
DEFAULT_PORTS = {"http": "80", "https": "443"}


def normalise_origin(value: str) -> str:
    """``scheme://host[:port]`` in lower case, the scheme's default port left out (how browsers
    write ``Origin``); ``null`` and anything unparsable come back lowered, matching nothing."""
    value = value.strip().lower().rstrip("/")
    scheme, sep, authority = value.partition("://")
    if not sep or not authority or "/" in authority:
        return value
    host, colon, port = authority.rpartition(":")
    if colon and port.isdigit() and not host.endswith(":") and port == DEFAULT_PORTS.get(scheme):
        authority = host  # "[::1]:80" -> "[::1]"; a bare IPv6 address has no port to strip
    return f"{scheme}://{authority}"


def parse_allowed_origins(value: str) -> frozenset[str]:
    """``--allow-origin`` entries (comma-separated, repeatable): ``*`` or ``scheme://host[:port]``."""
    allowed = set()
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        if entry == "*":
            allowed.add(entry)
            continue
        scheme, sep, authority = entry.partition("://")
        if scheme.lower() not in DEFAULT_PORTS or not sep or not authority or "/" in authority.rstrip("/"):
            raise ValueError(f"allow_origin entry {entry!r} is not an origin: give scheme://host[:port] "
                             "(e.g. https://app.example or http://localhost:3000) or *")
        allowed.add(normalise_origin(entry))
    return frozenset(allowed)
