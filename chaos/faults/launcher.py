"""A launcher a worker can be started through (``TestFleet.wrap_launch``): faults at start-up.

    python -m fleetward.chaos.faults.launcher [--state FILE] [--fail N] [--exit-code C] [--delay S]
                                             [--cgroup-procs PATH] -- ARGV...

In order: join the cgroup (write its own pid to ``PATH``, so the worker starts inside it), count this
start in ``FILE``, wait ``S`` seconds (a slow start, or a crash after a while), exit with ``C`` if this is
one of the first ``N`` starts (a crash loop), else ``exec`` ARGV (same pid: the worker's process handle
stays valid).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fleetward.chaos.faults.launcher")
    ap.add_argument("--state", type=Path)
    ap.add_argument("--fail", type=int, default=0)
    ap.add_argument("--exit-code", type=int, default=1)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--cgroup-procs", type=Path)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command after --")
    if args.cgroup_procs is not None:
        args.cgroup_procs.write_text(str(os.getpid()))
    start = 1
    if args.state is not None:
        try:
            start = int(args.state.read_text() or "0") + 1
        except FileNotFoundError:
            start = 1
        args.state.write_text(str(start))
    if args.delay > 0:
        time.sleep(args.delay)  # a separate program: this *is* the fault (a slow or doomed start)
    if start <= args.fail:
        print(f"fleetward chaos launcher: start {start} fails on purpose (crash loop: {args.fail} failing starts)",
              flush=True)
        return int(args.exit_code)
    sys.stdout.flush()
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
