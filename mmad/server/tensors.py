"""Tensors of inference and training requests over HTTP: parsed (JSON or binary, gzip/deflate
bodies) and answered; the engine checks them against the model (:func:`mmad.engine.inference.model_tensors`)."""

from __future__ import annotations

import mmap
import zlib

from fastapi import Request, Response

from mmad.engine.inference import ParsedRequest
from mmad.engine.runtime import Runtime
from mmad.errors import InvalidInput, MMADError, PayloadTooLarge
from mmad.server.binary import parse_header_length, parse_infer_request
from mmad.server.bodies import read_tensor_body

INFLATE_STEP = 1 << 20  # inflate in steps, so a bomb costs at most the cap plus one step


def decompress(body: bytes, encoding: str, limit: int) -> memoryview:
    """A gzip/deflate body (tritonclient's request_compression_algorithm), inflated to at most ``limit``.

    Inflated into an anonymous mapping of ``limit`` bytes: only the pages written count, and
    they go back to the system when the body is freed. In pieces joined at the end, a bomb held
    twice the cap, and the freed pieces stayed in the allocator's heaps: 50 bombs left the
    process 64 MiB larger for good (``scripts/attack.py gzip-bomb``)."""
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding)
    if wbits is None:
        raise InvalidInput(f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none")
    inflater = zlib.decompressobj(wbits)
    out, filled, pending = mmap.mmap(-1, limit), 0, body
    try:
        while not inflater.eof:
            chunk = inflater.decompress(pending, INFLATE_STEP)
            if filled + len(chunk) > limit:
                raise PayloadTooLarge(f"the decompressed body exceeds the limit of {limit} bytes")
            out[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
            pending = inflater.unconsumed_tail
            if not pending and len(chunk) < INFLATE_STEP:  # input used up and no output held back
                break
        if not inflater.eof:
            raise InvalidInput(f"the {encoding} body is truncated")
    except zlib.error as exc:
        out.close()
        raise InvalidInput(f"the {encoding} body cannot be decompressed: {exc}") from exc
    except MMADError:
        out.close()
        raise
    return memoryview(out)[:filled]


# Work on a small body or tensor runs inline on the event loop: a hop to the compute threads
# costs more than the work, and under load the hops queue behind each other and behind the
# batches (GIL hand-offs). Larger JSON parsing and encoding go to the threads so that they never
# stall the loop. Binary tensors are views of the body (np.frombuffer): cheap at any size (the
# engine's INLINE_TENSOR_VALUES bounds the tensors worked on inline).
INLINE_JSON_BYTES = 64 * 1024


async def parse_tensors(rt: Runtime, request: Request, resolve_shm: bool = True) -> ParsedRequest:
    """The request's body parsed (:func:`~mmad.server.binary.parse_infer_request`), decompressed
    first where it says so; on a compute thread when large."""
    body = await read_tensor_body(request)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        body = await rt.registry.run(decompress, body, encoding, rt.settings.max_body_bytes)
    header_length = parse_header_length(request.headers.get("inference-header-content-length"), len(body))
    if (len(body) if header_length is None else header_length) <= INLINE_JSON_BYTES:
        return parse_infer_request(body, header_length, rt.shm, resolve_shm)
    return await rt.registry.run(parse_infer_request, body, header_length, rt.shm, resolve_shm)


def accepted_encoding(accept: str | None) -> str | None:
    """``gzip`` or ``deflate`` as Triton picks from Accept-Encoding: the highest q among identity,
    deflate and gzip (q defaults to 1), the first listed on a tie; None for identity."""
    if not accept:
        return None
    best, weight = None, 0.0
    for part in accept.lower().split(","):
        coding, _, params = part.partition(";")
        q = 1.0
        params = params.strip()
        if params.startswith("q="):
            try:
                q = float(params[2:])
            except ValueError:
                continue
        coding = coding.strip()
        if coding in ("identity", "deflate", "gzip") and q > weight:
            best, weight = coding, q
    return None if best == "identity" else best


# float tensors shrink little however hard zlib works; level 1 costs a fraction of the default's time
COMPRESS_LEVEL = 1


def compress(body: bytes | memoryview, encoding: str) -> bytes:
    """``body`` as gzip or as deflate (the zlib format, which is what HTTP's deflate means)."""
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    packer = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, wbits)
    return packer.compress(body) + packer.flush()


def tensor_response(body: bytes, header_length: int | None, encoding: str | None = None) -> Response:
    headers = {}
    if encoding is not None:
        headers.update({"Content-Encoding": encoding, "Vary": "Accept-Encoding"})
    if header_length is None:
        return Response(body, media_type="application/json", headers=headers)
    headers["Inference-Header-Content-Length"] = str(header_length)
    return Response(body, media_type="application/octet-stream", headers=headers)
