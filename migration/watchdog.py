"""A diagnostic for a blocked event loop: when the loop does not run for ``threshold`` seconds, log where
its thread is stuck (the Python stack), once per stall.

Enabled in long-running fleetward processes by ``FLEETWARD_LOOP_WATCHDOG=<seconds>`` (see config).
A blocked loop is what makes leases expire and streams look stalled, so this names the culprit.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

__all__ = ["LoopWatchdog"]

log = logging.getLogger(__name__)


class LoopWatchdog:
    def __init__(self, threshold: float = 1.0) -> None:
        self.threshold = threshold
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._loop_thread = threading.get_ident()

    async def run(self) -> None:
        thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        thread.start()
        try:
            while True:
                self._beat = time.monotonic()
                await asyncio.sleep(self.threshold / 4)
        finally:
            self._stop.set()

    def _watch(self) -> None:
        reported = False
        while not self._stop.wait(self.threshold / 4):
            stalled = time.monotonic() - self._beat
            if stalled < self.threshold:
                reported = False
                continue
            if reported:
                continue
            reported = True
            frame = sys._current_frames().get(self._loop_thread)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
            log.warning("event loop blocked for %.2fs; it is at:\n%s", stalled, stack)
