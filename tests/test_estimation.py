"""The shared measured models: a read path's load time, and the decaying non-negative least squares."""

from __future__ import annotations

import math

import pytest

from sgl_kvtier.estimation import DecayingLeastSquares, DeviceModel

PB = 4 << 20  # 4 MiB pages (a large model's KV per page)


def test_load_time_counts_batches_and_bytes():
    d = DeviceModel(bandwidth_Bps=1e9, batch_latency_s=0.01)
    assert d.load_time(0, PB) == 0
    assert d.load_time(1, PB) == pytest.approx(0.01 + PB / 1e9)
    assert d.load_time(128, PB) == pytest.approx(0.01 + 128 * PB / 1e9)
    assert d.load_time(129, PB) == pytest.approx(0.02 + 129 * PB / 1e9)
    assert DeviceModel(math.inf, 0.01).load_time(300, PB) == pytest.approx(0.03)



def test_least_squares_fits_exactly_and_never_goes_negative():
    exact = DecayingLeastSquares(2, half_life=8, subsets=((0, 1), (0,), (1,)))
    for x in (1.0, 2.0, 5.0):
        exact.add((x, 1.0), 3 * x + 0.5)
    assert exact.solve() == pytest.approx([3.0, 0.5])
    negative = DecayingLeastSquares(2, half_life=8, subsets=((0, 1), (0,), (1,)))
    for x in (1.0, 2.0, 5.0):
        negative.add((x, 1.0), 3 * x - 1.0)  # the unconstrained fit has a negative intercept
    theta = negative.solve()
    assert theta is not None and theta[1] == 0.0 and theta[0] > 0
    assert negative.count == 3


def test_least_squares_forgets_old_samples_and_rejects_bad_half_lives():
    ls = DecayingLeastSquares(1, half_life=4, subsets=((0,),))
    assert ls.solve() is None  # nothing seen yet
    for _ in range(200):
        ls.add((1.0,), 1.0)
    for _ in range(200):
        ls.add((1.0,), 5.0)
    assert ls.solve() == pytest.approx([5.0], rel=1e-6)
    with pytest.raises(ValueError, match="half_life"):
        DecayingLeastSquares(1, half_life=0, subsets=((0,),))
