"""The cost curve's fit from noisy timings (redraft.pricing.fit) and the ratio timing it is fed
(redraft.pricing.measure.ratios), on synthetic timings: no clock anywhere."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redraft.pricing.fit import fit_costs
from redraft.pricing.measure import ratios

SIZES = [0, 1, 2, 3, 4, 8, 16, 32, 48, 64, 128, 256, 512]
# the 2-core development CPU, one thread, quiet machine (rounded medians): not monotonic at 2-3, near-linear past 64
QUIET = [1.0, 1.63, 1.99, 1.46, 1.62, 1.79, 2.25, 3.07, 3.63, 4.28, 7.22, 13.73, 26.9]


def exact(costs, repeats=5):
    """Samples that all equal the curve (no noise)."""
    return [[c] * repeats for c in costs]


def test_a_clean_physical_curve_is_returned_unchanged():
    fit = fit_costs(SIZES, exact(QUIET))
    assert fit.curve.sizes == tuple(SIZES)
    assert list(fit.curve.costs) == pytest.approx(QUIET)
    assert list(fit.median) == pytest.approx(QUIET)


def test_a_burst_at_one_wide_size_is_bounded_by_two_narrower_forwards():
    """Three of five 129-token samples taken during a burst put the median at 2.2 x c(64): the fit lowers it to
    c(63) + c(64), which the unburst samples allow; the 65-token samples are untouched."""
    samples = exact(QUIET)
    samples[SIZES.index(128)] = [7.3, 7.5, 9.4, 9.6, 9.9]
    fit = fit_costs(SIZES, samples)
    c = fit.curve
    assert fit.median[SIZES.index(128)] == pytest.approx(9.4)
    assert c.cost(128) == pytest.approx(c.cost(63) + c.cost(64))
    assert c.cost(128) <= 2 * c.cost(64)
    assert c.cost(64) == pytest.approx(4.28)


def test_a_wide_size_that_every_sample_prices_above_the_bound_is_lowered_only_to_its_quartile():
    samples = exact(QUIET)
    samples[-1] = [29.0, 29.4, 29.8, 30.1, 30.5]  # above c(255) + c(256) ~ 27.4 in every sample
    fit = fit_costs(SIZES, samples)
    assert fit.curve.cost(512) == pytest.approx(np.percentile(samples[-1], 25))
    assert fit.curve.cost(512) > fit.curve.cost(255) + fit.curve.cost(256)


def test_a_dip_every_sample_shows_stays_and_a_dip_within_noise_is_pooled():
    robust = exact(QUIET)
    robust[SIZES.index(2)] = [1.95, 1.97, 1.99, 2.01, 2.03]
    robust[SIZES.index(3)] = [1.44, 1.45, 1.46, 1.47, 1.48]
    fit = fit_costs(SIZES, robust)
    assert fit.curve.cost(3) < fit.curve.cost(2) - 0.4  # 3 draft tokens cost less than 2 here: kept

    noisy = exact(QUIET)
    noisy[SIZES.index(16)] = [2.1, 2.5, 2.6, 2.7, 3.3]  # median 2.6
    noisy[SIZES.index(32)] = [2.2, 2.45, 2.5, 2.9, 3.2]  # median 2.5: below 16's, the quartiles overlap
    fit = fit_costs(SIZES, noisy)
    assert fit.curve.cost(32) >= fit.curve.cost(16)
    assert 2.45 <= fit.curve.cost(32) <= 2.9 and 2.5 <= fit.curve.cost(16) <= 2.7  # within each quartile range


def test_sizes_without_zero_get_it_and_bad_input_names_the_problem():
    fit = fit_costs([1, 4], [[1.5, 1.6], [2.0]])
    assert fit.curve.sizes == (0, 1, 4) and fit.curve.costs[0] == 1.0
    assert set(fit.to_dict()) == {"sizes", "median", "low", "high", "fitted"}
    with pytest.raises(ValueError, match="sample lists"):
        fit_costs([0, 1], [[1.0]])
    with pytest.raises(ValueError, match="ascending"):
        fit_costs([0, 4, 2], [[1.0], [2.0], [1.5]])
    with pytest.raises(ValueError, match="size 4"):
        fit_costs([0, 4], [[1.0], []])
    with pytest.raises(ValueError, match="size 4"):
        fit_costs([0, 4], [[1.0], [float("nan")]])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.floats(0.5, 40.0), min_size=1, max_size=7), min_size=len(SIZES) - 1,
                max_size=len(SIZES) - 1))
def test_the_fit_stays_within_each_sizes_quartiles_and_is_sub_additive_where_they_allow(samples):
    fit = fit_costs(SIZES[1:], samples)
    c, f = fit.curve, fit.fitted
    assert np.all(f >= fit.low - 1e-9) and np.all(f <= fit.high + 1e-9)
    for i in range(2, len(SIZES)):
        n, top = SIZES[i], SIZES[i - 1]
        a = np.arange(max(0, n - 1 - top), (n - 1) // 2 + 1)
        if a.size:
            bound = float(np.min(c.at(a) + c.at(n - 1 - a)))
            assert f[i] <= bound + 1e-6 or f[i] == pytest.approx(fit.low[i])


def test_ratios_cancel_a_load_change_that_slows_a_sample_and_its_reference_forwards_alike():
    """Sizes timed during a 2x burst (sample and the 1-token forwards around it alike) keep their ratio; dividing
    medians of raw times, as the curve was measured before, puts the burst into the curve."""
    true = {1: 0.07, 65: 0.30, 129: 0.52}
    load = {1: [1, 1, 1], 65: [1, 1, 1], 129: [2, 2, 1]}  # two of three 129-token samples in a burst
    raw = {"chain": {s: [t * m for m in load[s]] for s, t in true.items()},
           "reference": {s: [true[1] * m for m in load[s]] for s in true}}
    rel = ratios(raw)
    assert np.median(rel[129]) == pytest.approx(0.52 / 0.07)
    assert np.median(raw["chain"][129]) / np.median(raw["chain"][1]) == pytest.approx(2 * 0.52 / 0.07)
