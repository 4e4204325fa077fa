"""The history of a chaos run: every operation every client made, every fault, every event.

A run writes ``history.jsonl``, one JSON object per line, appended in the order things happened. Every
record has ``type``, ``t`` (monotonic seconds since the run started) and ``wall`` (epoch seconds).

========== ==================================================================================================
type       fields
========== ==================================================================================================
invoke     ``req`` (client-side id), ``client`` (who sent it: ``workload``, ``probe``, a load fault such as
           ``load.burst``), ``api`` (completion or chat), ``prompt`` (the token ids the engine sees; chat: the
           rendered template), ``params`` (max_tokens, temperature, ignore_eos), ``router``, ``t_sched``
           (the planned arrival, seconds into the workload: open loop), ``retry_of`` (retries), ``slow`` (the
           ``load.slow_clients`` fault whose slow client this is)
chunk      ``req``, ``tokens`` (ids in this chunk), ``text``, ``event_id`` (the SSE id, ``<rid>:<n>``), ``rid``
           and ``n`` (its parts: the router's request id and its count of tokens so far), ``worker`` and
           ``attempt`` (from the router's trace header), ``finish_reason``
resume     ``req``, ``router`` (where the client reconnected), ``last_event_id``, ``after`` (the fail stage
           that broke the stream)
ok         ``req``, ``finish_reason``, ``usage``, ``tokens`` (how many were received)
fail       ``req``, ``error`` (message), ``status`` (HTTP status when known), ``stage``: ``connect``, ``status``,
           ``error_event`` (in-band error), ``transport`` (the connection broke), ``protocol`` (an event that
           is not JSON), ``eof`` (the body ended without ``[DONE]`` or an error: a silent truncation),
           ``timeout``, ``cancelled`` (the client disconnected on purpose), ``abandoned`` (still open when
           the workload's drain ended), ``aborted`` (the run stopped); ``tokens``. A failed operation has
           an **unknown** outcome: the checker does not assume the request did or did not take effect.
fault      ``phase`` (start, verified, recover, recovered, stop, failed, refused), ``activity`` (the method
           entry's name), ``fault`` (catalogue name), ``family``, ``target`` (the selector), ``targets`` (the
           resolved ids), ``params``, ``ok`` (for verified/recovered), ``detail``. The fault is *in effect*
           from ``start`` to ``recover``.
event      ``kind``, ``id``, ``ts`` (the publisher's wall clock) and the MQTT event's fields (what the
           reliability layer published: worker.down, health.changed, hang.detected, migration, restart,
           quarantine, scale, fault.start, fault.stop, ...)
phase      ``name`` (steady-state-before, method, steady-state-after, rollbacks), ``state`` (start, end)
probe      a steady-state probe: ``name``, ``probe``, ``when`` (before, after), ``value``, ``ok``, ``error``
note       ``text``: anything the runner wants in the record (client cap reached, rollbacks)
resources  ``phase`` (sample, end, after), ``procs`` (``role``, ``id``, ``pid``, ``rss_mb``, ``fds`` of the runner
           and each process it started), ``left`` (after: the run's processes still alive); see
           :mod:`fleetward.chaos.resources`
========== ==================================================================================================

Checkers run afterwards, on the saved file (``fleetward chaos check RUN``), never during the run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = ["History", "Record", "read_history"]


@dataclass(frozen=True)
class Record:
    type: str
    t: float
    wall: float
    data: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


class History:
    """An append-only JSONL recorder with a shared monotonic origin.

    Records go to the file only, never into a list kept in memory: a long run (the soak) would otherwise grow
    the runner's memory with every token, which is the process whose memory the run measures. Read them back
    with :func:`read_history` (after :meth:`flush`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("a", encoding="utf-8")
        self._t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def add(self, type_: str, **data: Any) -> Record:
        rec = Record(type_, self.now(), time.time(), data)
        self._file.write(json.dumps({"type": type_, "t": round(rec.t, 6), "wall": rec.wall, **data},
                                    separators=(",", ":")) + "\n")
        return rec

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_history(path: Path) -> Iterator[Record]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            body = json.loads(line)
            yield Record(body.pop("type"), body.pop("t"), body.pop("wall"), body)
