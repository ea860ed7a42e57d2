"""A job's loss history (mmad/engine/loss_history.py) stays bounded over any length of run and
still describes the whole of it: the first point is the first chunk's, the last ends at the
latest step, steps rise, and every point is exactly the mean of the per-step losses it stands
for (checked against the raw losses in float64); a NaN or Inf loss stays visible after merges."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mmad.engine.loss_history import LossHistory


def run(history: LossHistory, chunks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Adds ``chunks`` as a job does; the raw (step, loss) of every step."""
    steps, losses, step = [], [], 0
    for chunk in chunks:
        step += len(chunk)
        history.add(step, chunk)
        steps.extend(range(step - len(chunk) + 1, step + 1))
        losses.extend(chunk.tolist())
    return np.asarray(steps), np.asarray(losses, np.float64)


def check_against_raw(points, steps: np.ndarray, losses: np.ndarray) -> None:
    previous = 0
    for step, loss in points:
        covered = losses[(steps > previous) & (steps <= step)]
        assert covered.size > 0, (previous, step)
        assert loss == pytest.approx(covered.mean(), rel=1e-12), (previous, step)
        previous = step


@pytest.mark.parametrize("capacity", [4, 16, 1024])
@pytest.mark.parametrize("chunks", [1, 7, 1000, 5003])
def test_bounded_first_and_last_kept_steps_rising_means_exact(capacity, chunks):
    rng = np.random.default_rng(capacity * 10_000 + chunks)
    # a first chunk of one step (as a job's), then chunks of varied sizes
    sizes = [1] + rng.integers(1, 50, chunks - 1).tolist()
    data = [rng.lognormal(0, 1, n).astype(np.float32) for n in sizes]
    history = LossHistory(capacity)
    steps, losses = run(history, data)
    points = history.points()
    assert 0 < len(points) <= capacity
    assert len(points) >= min(chunks, capacity // 2 + 1)  # a merge halves the points, no more
    assert points[0] == [1, pytest.approx(float(data[0][0]))]
    assert points[-1][0] == steps[-1]
    assert all(a[0] < b[0] for a, b in zip(points, points[1:]))
    check_against_raw(points, steps, losses)
    if chunks <= capacity:  # nothing merged: a point per chunk
        assert [p[0] for p in points] == np.cumsum(sizes).tolist()


def test_points_stay_evenly_spread_after_merges():
    history = LossHistory(16)
    for step in range(1, 1001):  # a chunk of one step each: a point's chunks are its steps
        history.add(step, [float(step)])
    gaps = np.diff([p[0] for p in history.points()])
    assert len(set(gaps[1:-1].tolist())) == 1, gaps  # between the first point and the gathering last one
    assert gaps[-1] <= gaps[1]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_loss_stays_visible_after_merges(bad):
    history = LossHistory(8)
    for step in range(1, 101):
        history.add(step, [bad if step == 37 else 1.0])
    points = history.points()
    assert len(points) <= 8
    holding = [p for p in points if p[1] is None]
    assert len(holding) == 1, points
    i = points.index(holding[0])
    assert points[i - 1][0] < 37 <= points[i][0]
    assert all(p[1] == 1.0 for p in points if p[1] is not None)


def test_capacity_must_be_even_and_at_least_four():
    for capacity in (0, 3, 5):
        with pytest.raises(ValueError, match="capacity"):
            LossHistory(capacity)
    assert LossHistory(4).points() == []
