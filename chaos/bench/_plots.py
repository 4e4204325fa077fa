"""Plots of benchmark results (matplotlib, headless). Imported only when plots are wanted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["cdf", "grouped_bars", "stacked_bars"]

_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]


def grouped_bars(path: Path, *, title: str, groups: Sequence[str], series: Mapping[str, Sequence[float | None]],
                 ylabel: str, hline: float | None = None, log: bool = False, fmt: str = "{:.2f}",
                 rotate: bool = False) -> Path:
    fig, ax = plt.subplots(figsize=(10, 4.8) if rotate else (8, 4.2), dpi=110)
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ys = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, ys, width, label=name, color=_COLORS[i % len(_COLORS)])
        for b, v in zip(bars, values, strict=True):
            if v is not None:
                ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                            va="bottom", fontsize=7)
    if hline is not None:
        ax.axhline(hline, color="black", linewidth=0.8, linestyle="--")
    if rotate:
        ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    else:
        ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def stacked_bars(path: Path, *, title: str, groups: Sequence[str], series: Mapping[str, Sequence[float]],
                 ylabel: str) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=110)
    bottom = [0.0] * len(groups)
    for i, (name, values) in enumerate(series.items()):
        ax.bar(range(len(groups)), values, 0.6, bottom=bottom, label=name, color=_COLORS[i % len(_COLORS)])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def cdf(path: Path, *, title: str, series: Mapping[str, Sequence[tuple[float, float]]], xlabel: str,
        log: bool = True, vline: float | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for i, (name, points) in enumerate(series.items()):
        if points:
            ax.plot([ms for _, ms in points], [q for q, _ in points], label=name, color=_COLORS[i % len(_COLORS)])
    if vline is not None:
        ax.axvline(vline, color="black", linewidth=0.8, linestyle="--")
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
