"""Comparison helper shared by the tests: relative error against the float64 oracle."""

from __future__ import annotations

import numpy as np


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf when ``out`` holds NaN or Inf, so NaN never passes."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
