"""Load predictors: the next intervals' arrival rate from the rates observed so far.

``constant`` (the last value) and ``moving-average`` are the baselines; ``holt-winters`` (statsmodels'
exponential smoothing: damped additive trend, and an additive season when ``season_length`` is given and
two seasons have been seen) and ``arima`` (statsmodels' ARIMA) follow trends and cycles. The statsmodels
ones refit every ``refit_every`` observations on the last ``max_history`` points and fall back to the
last value while the history is too short or a fit fails. Forecasts are never negative.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from typing import Any, Protocol

from fleetward.fleet.errors import ConfigError

__all__ = ["PREDICTORS", "Arima", "Constant", "HoltWinters", "MovingAverage", "Predictor", "make_predictor"]

_MIN_FIT = 8


class Predictor(Protocol):
    name: str

    def observe(self, value: float) -> None: ...

    def forecast(self, horizon: int) -> list[float]: ...


class Constant:
    name = "constant"

    def __init__(self) -> None:
        self.last = 0.0

    def observe(self, value: float) -> None:
        self.last = value

    def forecast(self, horizon: int) -> list[float]:
        return [max(0.0, self.last)] * horizon


class MovingAverage:
    name = "moving-average"

    def __init__(self, window: int = 6) -> None:
        if window < 1:
            raise ConfigError(f"moving-average window must be >= 1, got {window}")
        self.values: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self.values.append(value)

    def forecast(self, horizon: int) -> list[float]:
        mean = sum(self.values) / len(self.values) if self.values else 0.0
        return [max(0.0, mean)] * horizon


class _Fitted:
    """Shared by the statsmodels predictors: bounded history, periodic refits, fallback."""

    name = ""

    def __init__(self, *, refit_every: int = 5, max_history: int = 480) -> None:
        self.history: deque[float] = deque(maxlen=max_history)
        self.refit_every = max(1, refit_every)
        self._fit: Any = None
        self._since = 0  # observations since the fit

    def observe(self, value: float) -> None:
        self.history.append(float(value))
        self._since += 1

    def _fit_model(self, series: list[float]) -> Any:
        raise NotImplementedError

    def _min_points(self) -> int:
        return _MIN_FIT

    def forecast(self, horizon: int) -> list[float]:
        last = self.history[-1] if self.history else 0.0
        if len(self.history) < self._min_points():
            return [max(0.0, last)] * horizon
        if self._fit is None or self._since >= self.refit_every:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    self._fit = self._fit_model(list(self.history))
                except Exception:  # statsmodels raises many kinds on degenerate series: use the fallback
                    self._fit = None
            self._since = 0
        if self._fit is None:
            return [max(0.0, last)] * horizon
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = list(self._fit.forecast(horizon + self._since))[self._since:]
        if len(values) != horizon or not all(math.isfinite(v) for v in values):
            return [max(0.0, last)] * horizon
        return [max(0.0, float(v)) for v in values]


class HoltWinters(_Fitted):
    name = "holt-winters"

    def __init__(self, season_length: int | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.season_length = season_length

    def _fit_model(self, series: list[float]) -> Any:
        from statsmodels.tsa.holtwinters import ExponentialSmoothing

        seasonal = self.season_length is not None and len(series) >= 2 * self.season_length
        model = ExponentialSmoothing(series, trend="add", damped_trend=True,
                                     seasonal="add" if seasonal else None,
                                     seasonal_periods=self.season_length if seasonal else None,
                                     initialization_method="estimated")
        return model.fit()


class Arima(_Fitted):
    name = "arima"

    def __init__(self, order: tuple[int, int, int] = (2, 1, 1), **options: Any) -> None:
        super().__init__(**options)
        self.order = order

    def _fit_model(self, series: list[float]) -> Any:
        from statsmodels.tsa.arima.model import ARIMA

        return ARIMA(series, order=self.order).fit()


PREDICTORS: dict[str, type] = {c.name: c for c in (Constant, MovingAverage, HoltWinters, Arima)}


def make_predictor(name: str, **options: Any) -> Predictor:
    cls = PREDICTORS.get(name)
    if cls is None:
        raise ConfigError(f"unknown predictor {name!r}; choose from {', '.join(PREDICTORS)}")
    predictor: Predictor = cls(**options)
    return predictor
