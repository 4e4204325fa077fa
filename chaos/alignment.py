"""A delivered token stream aligned with its fault-free reference: each divergence named (lost, duplicated,
reordered, corrupted) and located, for the stream-exactness checker (:mod:`fleetward.chaos.checkers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Anomaly", "align"]

_RESYNC = 8  # tokens that must agree after a hypothesis for it to be believed
_MAX_SPAN = 1024  # longest loss / corruption looked for
_MAX_DUP = 64  # longest duplicated run looked for
_DUP_LOOKBACK = 512  # how far back a duplicated run may come from
_MAX_REORDER = 8


@dataclass(frozen=True)
class Anomaly:
    kind: str  # lost | duplicated | reordered | truncated | corrupted
    index: int  # position in the delivered stream
    ref_index: int  # position in the reference
    count: int  # tokens involved
    note: str = ""


def _agrees(d: Sequence[int], a: int, r: Sequence[int], b: int, *, need_tokens: bool = False) -> bool:
    n = min(_RESYNC, len(d) - a)
    if n <= 0:
        return not need_tokens
    return len(r) - b >= n and list(d[a:a + n]) == list(r[b:b + n])


def _occurs(seg: Sequence[int], hay: Sequence[int]) -> bool:
    m, seg = len(seg), list(seg)
    lo = max(0, len(hay) - _DUP_LOOKBACK)
    return any(list(hay[k:k + m]) == seg for k in range(len(hay) - m, lo - 1, -1))


def align(delivered: Sequence[int], expected: Sequence[int]) -> tuple[list[Anomaly], int, int]:
    """Walk the delivered stream against the reference and name each divergence.

    At a divergence the smallest explanation after which the streams agree again (for 8 tokens, or to
    the end) wins; for each size, reordered, then duplicated, then lost, then corrupted. A divergence
    nothing explains is ``corrupted`` to the end. Returns the anomalies and how much of each stream was
    consumed (what is left of the reference is a missing tail: the caller decides truncated or honest).
    """
    d, r = delivered, expected
    i = j = 0
    out: list[Anomaly] = []
    while i < len(d) and j < len(r):
        if d[i] == r[j]:
            i += 1
            j += 1
            continue
        found: tuple[str, int, int] | None = None
        for m in range(1, _MAX_SPAN + 1):
            if i + m > len(d) and j + m > len(r):
                break
            if (2 <= m <= _MAX_REORDER and i + m <= len(d) and j + m <= len(r)
                    and sorted(d[i:i + m]) == sorted(r[j:j + m]) and _agrees(d, i + m, r, j + m)):
                found = ("reordered", m, m)
            elif (m <= _MAX_DUP and i + m <= len(d) and _agrees(d, i + m, r, j)
                  and _occurs(d[i:i + m], r[:j])):
                found = ("duplicated", m, 0)
            elif j + m <= len(r) and _agrees(d, i, r, j + m, need_tokens=True):
                found = ("lost", 0, m)
            elif i + m <= len(d) and j + m <= len(r) and _agrees(d, i + m, r, j + m):
                found = ("corrupted", m, m)
            if found:
                break
        if found is None:
            out.append(Anomaly("corrupted", i, j, len(d) - i, "diverged for good"))
            return out, len(d), j
        kind, di, dj = found
        to_end = kind == "corrupted" and di > 1 and i + di == len(d)
        out.append(Anomaly(kind, i, j, max(di, dj), "diverged for good" if to_end else ""))
        i += di
        j += dj
    if i < len(d):  # more than the reference holds
        kind = "duplicated" if _occurs(d[i:], list(r)) else "corrupted"
        out.append(Anomaly(kind, i, j, len(d) - i, "beyond the end of the reference"))
        i = len(d)
    return out, i, j
