"""Many simulated workers in one process: one HTTP server, worker ``i`` under the path prefix ``/w/<i>``.

``python -m fleetward.chaos.bench._multisim --port P --workers N [--config-json '{...SimConfig...}']``

Each worker is a full :class:`~fleetward.sim.server.SimWorker` (its own engine, metrics and admin
endpoints); a request for ``/w/17/v1/completions`` is served by worker 17 as ``/v1/completions``. A
worker registered in etcd with the URL ``http://127.0.0.1:P/w/17`` is therefore reached by the
controller's canaries and scrapes, and by routers, exactly like a worker of its own process (they append
paths to the registered URL). Prints ``READY`` once it serves. An idle engine waits on an event and
costs nothing; the process's CPU is what the requests cost.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from collections.abc import Sequence

import uvicorn
from starlette.types import Receive, Scope, Send

from fleetward.fleet.config import SimConfig
from fleetward.sim.server import SimWorker

__all__ = ["MultiSim", "main"]


class MultiSim:
    """An ASGI app dispatching ``/w/<i>/...`` to the i-th of ``n`` simulated workers."""

    def __init__(self, config: SimConfig, n: int, *, admin_token: str) -> None:
        self.workers = [SimWorker(config, admin_token=admin_token, crash=lambda: None) for _ in range(n)]
        self._engines: list[asyncio.Task[None]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path: str = scope["path"]
        parts = path.split("/", 3)  # "", "w", "<i>", rest
        try:
            worker = self.workers[int(parts[2])] if len(parts) >= 3 and parts[1] == "w" else None
        except (ValueError, IndexError):
            worker = None
        if worker is None:
            if scope["type"] == "http":
                await send({"type": "http.response.start", "status": 404, "headers": []})
                await send({"type": "http.response.body", "body": b"no such worker"})
            return
        rest = "/" + (parts[3] if len(parts) > 3 else "")
        await worker.app({**scope, "path": rest, "raw_path": rest.encode(), "root_path": ""}, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._engines = [asyncio.create_task(w.engine.run(), name=f"sim-engine-{i}")
                                 for i, w in enumerate(self.workers)]
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for t in self._engines:
                    t.cancel()
                await asyncio.gather(*self._engines, return_exceptions=True)
                await send({"type": "lifespan.shutdown.complete"})
                return


class _Server(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        print("READY", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fleetward.chaos.bench._multisim")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--config-json", default=None)
    ap.add_argument("--admin-token", default="bench")
    args = ap.parse_args(argv)
    config = SimConfig.model_validate_json(args.config_json) if args.config_json else SimConfig()
    app = MultiSim(config, args.workers, admin_token=args.admin_token)
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                                    lifespan="on", loop="uvloop", http="httptools", backlog=4096))
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
