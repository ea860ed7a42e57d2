"""How a serving process (the daemon, or a serving worker of ``mmad serve --workers``) runs:
NumPy's BLAS threads, and uvicorn's HTTP protocol with its connection cap."""

from __future__ import annotations

import logging

from mmad.settings import Settings

log = logging.getLogger("mmad.server")


def limit_blas_threads(threads: int) -> None:
    """Cap the BLAS thread pool of this process (0: leave it as the library set it).

    The event loop needs a core of its own: with OpenBLAS's default threads, a forward over a
    batch of a few hundred rows (what dynamic batching builds) ran up to 100x slower on a busy
    2-core machine (docs/service-performance.md). Applied at run time with threadpoolctl, which
    sees only libraries already loaded, hence the NumPy import.
    """
    if threads <= 0:
        return
    import numpy  # noqa: F401
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        log.warning("threadpoolctl is not installed: NumPy's BLAS keeps its default threads "
                    "(--blas-threads %d ignored; install mmad's dependencies)", threads)
        return

    threadpool_limits(limits=threads, user_api="blas")
    limited = sorted({i["internal_api"] for i in threadpool_info() if i.get("user_api") == "blas"})
    if limited:
        log.info("BLAS (%s) limited to %d thread(s)", ", ".join(limited), threads)
    else:
        log.warning("--blas-threads %d: NumPy loaded no BLAS library that can be limited", threads)


def http_protocol(settings: Settings):
    """uvicorn's ``http=``: httptools (``auto`` when it is installed) as :mod:`mmad.server.http_protocol`'s
    protocol, which reads large infer bodies in place and bounds connections; h11 as uvicorn has it."""
    if settings.http == "h11":
        log.warning("--http h11: the connection cap, the request head timeout and the header size cap "
                    "apply only with httptools (docs/reliability.md)")
        return "h11"
    try:
        import httptools  # noqa: F401
    except ImportError:  # as uvicorn does: auto falls back to h11, an explicit httptools fails at start-up
        return settings.http
    from mmad.server.http_protocol import ConnectionLimits, protocol_class

    return protocol_class(settings.max_body_bytes, ConnectionLimits(
        max_connections=connection_cap(settings.max_connections, settings.health_slots),
        head_timeout_s=settings.head_timeout_s, max_header_bytes=settings.max_header_bytes,
        health_slots=settings.health_slots, body_timeout_s=settings.body_timeout_s,
        min_body_rate=settings.min_body_rate, max_pending_body_bytes=settings.max_pending_body_bytes))


FD_RESERVE = 256  # descriptors kept for the store, devices, logs and the listening socket


def connection_cap(wanted: int, health_slots: int = 0) -> int:
    """``wanted`` connections, or fewer if the descriptor limit (raised to its hard limit) cannot
    hold them and the ``health_slots`` beside them: past it accept() fails and even health probes
    go unanswered."""
    try:
        import resource
    except ImportError:
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + health_slots + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        cap = max(1, soft - FD_RESERVE - health_slots)
        log.warning("max_connections %d lowered to %d: the open-file limit is %d", wanted, cap, soft)
        return cap
    return wanted
