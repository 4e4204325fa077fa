"""The benchmark client: many concurrent streams in one process, every token event timestamped.

Runs as its own process (``python -m fleetward.chaos.bench._loadgen``) so the client's CPU is its own
and visible: it reads a JSON spec on stdin and writes one JSON result to the spec's ``result_path``.
The parent starts one or more of them with the same ``start_at`` (``time.monotonic()`` is system-wide
on Linux, so every process and the parent share one time line).

Spec keys: ``urls`` (the client load-balances round robin over them itself), ``path``, ``body`` (the
request; ``prompt`` is replaced by ``prompt_len`` random token ids per request), ``streams``,
``start_at``, ``warmup_s`` and ``duration_s`` (the measured window), ``requests_per_stream`` (``null``:
closed loop until the window ends; ``n``: each stream sends ``n`` requests and the run ends when all are
done or at ``max_s``), ``trace`` (ask the router which worker produced each chunk and keep a per-request
record), ``cpu_pids`` (``{"component": [pid, ...]}`` whose CPU use is sampled over the window), ``seed``.

Result: tokens and requests in the window, every inter-token gap and TTFT in the window (microseconds),
errors by message, CPU cores used per component (the client itself under ``client``), and with
``trace`` one record per request (tokens, worker switches with the gap at each, largest gap).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import psutil

__all__ = ["main", "run"]


@dataclass
class _Record:
    worker: str | None = None
    tokens: int = 0
    first_at: float | None = None
    last_at: float | None = None
    max_gap: float = 0.0
    switches: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    started: float = 0.0
    prompt_len: int = 0
    finished: bool = False


class _Run:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.urls: list[str] = spec["urls"]
        self.path: str = spec.get("path", "/v1/completions")
        self.body: dict[str, Any] = dict(spec["body"])
        self.prompt_len: int = int(spec.get("prompt_len", 32))
        self.trace: bool = bool(spec.get("trace"))
        self.start_at: float = float(spec["start_at"])
        self.w0 = self.start_at + float(spec.get("warmup_s", 0.0))
        self.w1 = self.w0 + float(spec["duration_s"])
        self.rng = random.Random(spec.get("seed", 0))
        self.next_url = itertools.count(int(spec.get("url_offset", 0)))
        self.tokens = 0
        self.ok = 0
        self.failed = 0
        self.errors: dict[str, int] = {}
        self.gaps: list[int] = []
        self.ttft: list[int] = []
        self.records: list[_Record] = []

    def _payload(self) -> tuple[bytes, int]:
        body = dict(self.body)
        body["prompt"] = [self.rng.randrange(16, 250) for _ in range(self.prompt_len)]
        body["stream"] = True
        return orjson.dumps(body), self.prompt_len

    def _fail(self, message: str, rec: _Record) -> None:
        self.failed += 1
        self.errors[message] = self.errors.get(message, 0) + 1
        rec.error = message

    async def _request(self, session: aiohttp.ClientSession) -> None:
        url = self.urls[next(self.next_url) % len(self.urls)] + self.path
        payload, plen = self._payload()
        rec = _Record(started=time.monotonic(), prompt_len=plen)
        if self.trace:
            self.records.append(rec)
        headers = {"content-type": "application/json"}
        if self.trace:
            headers["x-fleetward-trace"] = "1"
        w0, w1 = self.w0, self.w1
        try:
            async with session.post(url, data=payload, headers=headers) as resp:
                if resp.status != 200:
                    text = (await resp.read())[:200].decode(errors="replace")
                    self._fail(f"HTTP {resp.status}: {text}", rec)
                    return
                buf = b""
                prev: float | None = None
                async for data in resp.content.iter_any():
                    now = time.monotonic()
                    buf += data
                    while (i := buf.find(b"\n\n")) >= 0:
                        event, buf = buf[:i], buf[i + 2:]
                        j = event.find(b"data: ")
                        if j < 0:
                            continue
                        raw = event[j + 6:]
                        if raw == b"[DONE]":
                            rec.finished = True
                            break
                        obj = orjson.loads(raw)
                        if "error" in obj:
                            err = obj["error"]
                            self._fail(str(err.get("message", err) if isinstance(err, dict) else err)[:200], rec)
                            return
                        choices = obj.get("choices")
                        if not choices:
                            continue
                        c = choices[0]
                        ids = c.get("token_ids")
                        n = len(ids) if ids is not None else (1 if c.get("text") else 0)
                        if not n:
                            continue
                        in_window = w0 <= now <= w1
                        if prev is None:
                            if in_window:
                                self.ttft.append(int((now - rec.started) * 1e6))
                            rec.first_at = now
                        else:
                            gap = now - prev
                            if in_window:
                                self.gaps.append(int(gap * 1e6))
                            rec.max_gap = max(rec.max_gap, gap)
                        if in_window:
                            self.tokens += n
                        if self.trace:
                            worker = (obj.get("fleetward") or {}).get("worker")
                            if rec.worker is not None and worker != rec.worker and prev is not None:
                                rec.switches.append({"from": rec.worker, "to": worker, "gap_s": now - prev,
                                                     "at": now, "tokens_before": rec.tokens})
                            rec.worker = worker
                        rec.tokens += n
                        prev = now
                        rec.last_at = now
                if rec.finished:
                    self.ok += 1
                else:
                    self._fail("stream ended without [DONE]", rec)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            self._fail(f"{type(exc).__name__}: {exc}"[:200], rec)

    async def _stream(self, session: aiohttp.ClientSession, n: int | None) -> None:
        done = 0
        while n is None or done < n:
            await self._request(session)
            done += 1

    async def run(self) -> dict[str, Any]:
        cpu_procs: dict[str, list[psutil.Process]] = {}
        for name, pids in (self.spec.get("cpu_pids") or {}).items():
            cpu_procs[name] = []
            for pid in pids:
                with contextlib.suppress(psutil.Error):
                    cpu_procs[name].append(psutil.Process(pid))
        me = psutil.Process()

        def cpu_now() -> dict[str, float]:
            out: dict[str, float] = {}
            for name, procs in cpu_procs.items():
                total = 0.0
                for p in procs:
                    with contextlib.suppress(psutil.Error):
                        t = p.cpu_times()
                        total += t.user + t.system
                out[name] = total
            t = me.cpu_times()
            out["client"] = t.user + t.system
            return out

        n = self.spec.get("requests_per_stream")
        await asyncio.sleep(max(0.0, self.start_at - time.monotonic()))
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=float(self.spec.get("sock_read_s", 60)))
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
            tasks = [asyncio.create_task(self._stream(session, n)) for _ in range(int(self.spec["streams"]))]
            await asyncio.sleep(max(0.0, self.w0 - time.monotonic()))
            c0, t0 = cpu_now(), time.monotonic()
            if n is None:
                await asyncio.sleep(max(0.0, self.w1 - time.monotonic()))
            else:
                deadline = self.start_at + float(self.spec.get("max_s", 120))
                await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
            c1, t1 = cpu_now(), time.monotonic()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        window = t1 - t0
        result: dict[str, Any] = {
            "window_s": window, "tokens": self.tokens, "requests_ok": self.ok, "requests_failed": self.failed,
            "errors": self.errors, "gaps_us": self.gaps, "ttft_us": self.ttft,
            "cpu_cores": {k: (c1[k] - c0[k]) / window if window > 0 else 0.0 for k in c1},
        }
        if self.trace:
            result["records"] = [
                {"tokens": r.tokens, "prompt_len": r.prompt_len, "max_gap_s": r.max_gap, "switches": r.switches,
                 "error": r.error, "finished": r.finished, "started": r.started, "first_at": r.first_at,
                 "last_at": r.last_at}
                for r in self.records
            ]
        return result


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    return await _Run(spec).run()


def main() -> None:
    from fleetward.chaos.bench._common import client_main

    client_main(run)


if __name__ == "__main__":
    main()
