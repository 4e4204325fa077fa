"""Load predictors on series with known answers: a step, a ramp, a daily cycle."""

from __future__ import annotations

import math
import random

import pytest

from fleetward.autoscale.predict import PREDICTORS, make_predictor
from fleetward.fleet.errors import ConfigError


def fed(name: str, series: list[float], **options: object) -> list[float]:
    p = make_predictor(name, **options)
    for v in series:
        p.observe(v)
    return p.forecast(5)


def test_after_a_step_every_predictor_settles_on_the_new_level() -> None:
    step = [10.0] * 30 + [30.0] * 30
    assert fed("constant", step) == [30.0] * 5
    assert fed("moving-average", step, window=6) == [30.0] * 5
    assert fed("moving-average", step[:33], window=6)[0] == pytest.approx(20.0)  # halfway through its window
    for name in ("holt-winters", "arima"):
        assert all(abs(v - 30) < 1.5 for v in fed(name, step)), name


def test_on_a_ramp_the_trend_aware_predictors_lead_and_the_baselines_lag() -> None:
    ramp = [2.0 * t for t in range(60)]
    ahead = [2.0 * t for t in range(60, 65)]
    for name in ("holt-winters", "arima"):
        got = fed(name, ramp)
        assert all(abs(g - a) < 0.05 * a for g, a in zip(got, ahead, strict=True)), (name, got)
    for name in ("constant", "moving-average"):
        assert all(g <= a - 2 for g, a in zip(fed(name, ramp), ahead, strict=True)), name
    # Refitting every 5 observations instead of each: the same forecast to within a few percent.
    every = fed("holt-winters", ramp, refit_every=1)
    assert every == pytest.approx(fed("holt-winters", ramp, refit_every=5), rel=0.05)


def test_a_daily_cycle_is_learnt_by_the_seasonal_fit() -> None:
    rng = random.Random(7)
    season = 48
    series = [10 + 6 * math.sin(2 * math.pi * t / season) + rng.gauss(0, 0.3) for t in range(4 * season)]
    truth = [10 + 6 * math.sin(2 * math.pi * t / season) for t in range(4 * season, 4 * season + season // 2)]
    hw = make_predictor("holt-winters", season_length=season)
    const = make_predictor("constant")
    for v in series:
        hw.observe(v)
        const.observe(v)
    err_hw = sum(abs(a - b) for a, b in zip(hw.forecast(season // 2), truth, strict=True)) / len(truth)
    err_const = sum(abs(a - b) for a, b in zip(const.forecast(season // 2), truth, strict=True)) / len(truth)
    assert err_hw < 1.0 and 3 * err_hw < err_const


def test_short_histories_fall_back_and_forecasts_are_never_negative() -> None:
    for name in PREDICTORS:
        assert fed(name, []) == [0.0] * 5
        assert fed(name, [3.0, 4.0]) in ([4.0] * 5, [3.5] * 5)
        falling = [max(0.0, 40.0 - 2 * t) for t in range(40)]
        assert all(v >= 0 for v in fed(name, falling)), name


def test_an_unknown_predictor_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="holt-winters"):
        make_predictor("prophet")
