"""Training sets: uploaded chunks checked against the model.

A dataset lives in the store as chunk files (:mod:`mmad.server.store`); an uploaded chunk is
checked here (:func:`check_chunk`: its header, the model's column counts, finite values, one
memory-mapped block at a time) before the store moves it into place.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mmad.errors import InvalidInput
from mmad.server.store import ChunkHeader, chunk_arrays, read_chunk_header
from mmad.spec import MLPSpec

FINITE_BLOCK_VALUES = 1 << 22  # values checked at once (16 MiB of float32): the page cache does the rest


def _all_finite(block: np.ndarray) -> bool:
    if block.dtype == np.float16:  # the exponent test: NumPy's float16 isfinite is ~10x slower
        return (block.view(np.uint16) & np.uint16(0x7C00)).max(initial=0) != 0x7C00
    return bool(np.isfinite(block).all())


def check_chunk(spec: MLPSpec, path: Path) -> ChunkHeader:
    """A received chunk's header, checked against the model: x [rows, n_input_dims] and y [rows,
    n_output_dims], float32 or float16, every value finite (400 in the user's words otherwise)."""
    header = read_chunk_header(path)
    for name, cols, want, dims in (("x", header.x_cols, spec.n_input_dims, "n_input_dims"),
                                   ("y", header.y_cols, spec.n_output_dims, "n_output_dims")):
        if cols != want:
            raise InvalidInput(f"dataset {name} must have {want} columns (the model's {dims}); this chunk's "
                               f"{name} has {cols}")
    x, y = chunk_arrays(path, header)
    for name, array in (("x", x), ("y", y)):
        step = max(1, FINITE_BLOCK_VALUES // max(1, array.shape[1]))
        for start in range(0, array.shape[0], step):
            block = array[start:start + step]
            if not _all_finite(block):
                row = start + int(np.flatnonzero(~np.isfinite(block).all(axis=1))[0])
                raise InvalidInput(f"dataset {name} holds NaN or Inf (row {row} of this chunk)")
    return header
