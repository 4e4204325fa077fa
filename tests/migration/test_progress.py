"""The progress model's window of inter-token gaps (migration/progress.py): bucketed, so adding a gap is
cheap; its quantiles stay within one bucket of the exact ones over the last ``size`` samples."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fleetward.migration.progress import _Window

gaps = st.lists(st.floats(1e-4, 60.0, allow_nan=False), min_size=1, max_size=300)


@given(gaps, st.integers(1, 64), st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]))
def test_a_quantile_is_the_exact_one_of_the_last_samples_within_one_bucket(xs: list[float], size: int,
                                                                         q: float) -> None:
    w = _Window(size)
    for x in xs:
        w.add(x)
    last = sorted(xs[-size:])
    exact = last[min(len(last) - 1, int(q * len(last)))]
    got = w.quantile(q)
    assert got is not None and exact * (1 - 1e-9) <= got <= exact * 1.05 * (1 + 1e-9)
    assert len(w) == len(last)


def test_an_empty_window_has_no_quantile() -> None:
    assert _Window(8).quantile(0.99) is None
