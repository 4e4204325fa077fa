"""A benchmark client for a request *mix*: closed loop (``streams``) or open loop (Poisson ``rate``).

Runs as its own process (``python -m fleetward.chaos.bench._openloop``), like ``_loadgen``: it reads a
JSON spec on stdin and writes one JSON result to the spec's ``result_path``, so its CPU is its own.

Spec keys: ``urls`` (round robin), ``path``, ``body`` (the request; ``prompt`` and ``max_tokens`` are set
per request from the mix), ``mix`` (a list of ``{"weight", "prompt": [lo, hi], "max_tokens": [lo, hi]}``,
lengths uniform in each range), ``streams`` (closed loop: that many streams, each sending its next request
when the previous one ends) or ``rate`` (open loop: Poisson arrivals at that many requests per second,
never waiting for earlier requests), ``start_at`` (``time.monotonic()``, shared by all processes on
Linux), ``warmup_s`` and ``duration_s`` (the measured window; arrivals and closed-loop streams stop at
its end), ``drain_s`` (how long requests still open at the end may take to finish before they are
cancelled), ``seed``.

Result: requests sent / finished (ok) / failed in the window (by arrival for the open loop, by
completion for the closed loop), errors by message, TTFT and largest inter-token gap per request
(microseconds), tokens, and the client's own CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from typing import Any

import aiohttp
import orjson
import psutil

__all__ = ["main", "run"]


class _Run:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.urls: list[str] = spec["urls"]
        self.path: str = spec.get("path", "/v1/completions")
        self.body: dict[str, Any] = dict(spec["body"])
        self.mix: list[dict[str, Any]] = spec["mix"]
        self.weights = [float(m["weight"]) for m in self.mix]
        self.start_at = float(spec["start_at"])
        self.w0 = self.start_at + float(spec.get("warmup_s", 0.0))
        self.w1 = self.w0 + float(spec["duration_s"])
        self.rng = random.Random(spec.get("seed", 0))
        self.next_url = itertools.count()
        self.sent = 0
        self.ok = 0
        self.failed = 0
        self.completed_in_window = 0
        self.tokens_in_window = 0
        self.errors: dict[str, int] = {}
        self.ttft: list[int] = []
        self.max_gaps: list[int] = []
        self.prompt_tokens = 0

    def _payload(self) -> tuple[bytes, int]:
        m = self.rng.choices(self.mix, weights=self.weights)[0]
        plen = self.rng.randint(int(m["prompt"][0]), int(m["prompt"][1]))
        body = dict(self.body)
        body["prompt"] = [self.rng.randrange(16, 250) for _ in range(plen)]
        body["max_tokens"] = self.rng.randint(int(m["max_tokens"][0]), int(m["max_tokens"][1]))
        body["stream"] = True
        return orjson.dumps(body), plen

    def _fail(self, message: str) -> None:
        self.failed += 1
        self.errors[message] = self.errors.get(message, 0) + 1

    async def _request(self, session: aiohttp.ClientSession) -> None:
        url = self.urls[next(self.next_url) % len(self.urls)] + self.path
        payload, plen = self._payload()
        started = time.monotonic()
        counted = self.w0 <= started <= self.w1
        if counted:
            self.sent += 1
            self.prompt_tokens += plen
        first: float | None = None
        prev: float | None = None
        max_gap = 0.0
        done = False
        try:
            async with session.post(url, data=payload, headers={"content-type": "application/json"}) as resp:
                if resp.status != 200:
                    text = (await resp.read())[:200].decode(errors="replace")
                    self._fail(f"HTTP {resp.status}: {text}")
                    return
                buf = b""
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
                            done = True
                            break
                        obj = orjson.loads(raw)
                        if "error" in obj:
                            err = obj["error"]
                            self._fail(str(err.get("message", err) if isinstance(err, dict) else err)[:200])
                            return
                        choices = obj.get("choices")
                        if not choices:
                            continue
                        ids = choices[0].get("token_ids")
                        n = len(ids) if ids is not None else (1 if choices[0].get("text") else 0)
                        if not n:
                            continue
                        if first is None:
                            first = now
                            if counted:
                                self.ttft.append(int((now - started) * 1e6))
                        elif prev is not None:
                            max_gap = max(max_gap, now - prev)
                        if self.w0 <= now <= self.w1:
                            self.tokens_in_window += n
                        prev = now
            if done:
                self.ok += 1
                if self.w0 <= time.monotonic() <= self.w1:
                    self.completed_in_window += 1
                if counted:
                    self.max_gaps.append(int(max_gap * 1e6))
            else:
                self._fail("stream ended without [DONE]")
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            self._fail(f"{type(exc).__name__}: {exc}"[:200])

    async def _stream(self, session: aiohttp.ClientSession) -> None:
        while time.monotonic() < self.w1:
            await self._request(session)

    async def run(self) -> dict[str, Any]:
        me = psutil.Process()
        await asyncio.sleep(max(0.0, self.start_at - time.monotonic()))
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=float(self.spec.get("sock_read_s", 120)))
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
            cpu0 = None
            if self.spec.get("streams"):
                tasks = {asyncio.create_task(self._stream(session)) for _ in range(int(self.spec["streams"]))}
                await asyncio.sleep(max(0.0, self.w0 - time.monotonic()))
                cpu0 = me.cpu_times()
                await asyncio.sleep(max(0.0, self.w1 - time.monotonic()))
            else:
                rate = float(self.spec["rate"])
                t = time.monotonic()
                while t < self.w1:
                    if cpu0 is None and t >= self.w0:
                        cpu0 = me.cpu_times()
                    await asyncio.sleep(max(0.0, t - time.monotonic()))
                    task = asyncio.create_task(self._request(session))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    t += self.rng.expovariate(rate)
            cpu1 = me.cpu_times()
            cpu0 = cpu0 or cpu1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(float(self.spec.get("drain_s", 30.0))):
                    while tasks:
                        await asyncio.wait(set(tasks))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        window = float(self.spec["duration_s"])
        return {"window_s": window, "sent": self.sent, "requests_ok": self.ok, "requests_failed": self.failed,
                "completed_in_window": self.completed_in_window, "tokens_in_window": self.tokens_in_window,
                "prompt_tokens_sent": self.prompt_tokens, "errors": self.errors, "ttft_us": self.ttft,
                "max_gap_us": self.max_gaps,
                "client_cpu_cores": (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / window if window else 0.0}


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    return await _Run(spec).run()


def main() -> None:
    from fleetward.chaos.bench._common import client_main

    client_main(run)


if __name__ == "__main__":
    main()
