"""Ordered shutdown of a long-running command: signals only record, the main loop acts.

:func:`install_stop_handlers` makes the first SIGINT or SIGTERM set an :class:`asyncio.Event` that the
command's main loop waits on (it then stops in order: stop accepting, drain, cancel, close, reap
children). A second signal forces: every descendant process is killed at once and the process exits
with 130 (children started with ``PR_SET_PDEATHSIG`` die with it anyway).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable

from fleetward.fleet.procs import kill_tree, tree_of

__all__ = ["install_stop_handlers"]


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def install_stop_handlers(stop: asyncio.Event, *, say: Callable[[str], None] = _stderr) -> None:
    """SIGINT and SIGTERM set ``stop``; a second one kills every descendant and exits (130)."""
    loop = asyncio.get_running_loop()

    def on_signal(signame: str) -> None:
        if stop.is_set():
            say(f"{signame} again: forcing exit")
            kill_tree(tree_of(os.getpid())[1:])
            os._exit(130)
        say(f"\n{signame}: stopping (again to force)")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, signal.Signals(sig).name)
