"""Running a router as a process: state store, event bus, the app, uvicorn, ordered shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI

from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import RouterConfig
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import ensure_port
from fleetward.migration.router import Router

__all__ = ["serve_router"]

log = logging.getLogger(__name__)


async def serve_router(config: RouterConfig, *, etcd: str, mqtt: str, cluster: str, router_id: str | None = None,
                       on_ready: Callable[[Router], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn's handlers), then drain, deregister and close."""
    # Starlette imports anyio's asyncio backend on the first streaming response; under CPU pressure that
    # import alone blocked the loop for seconds (long enough to look like a stall). Import it now.
    importlib.import_module("anyio._backends._asyncio")
    port = ensure_port(config.host, config.port, name="router")
    store = EtcdStore(etcd)
    await store.get(Keys(cluster).root)  # a clear StoreUnavailable now rather than later
    bus = await MqttBus(mqtt, cluster).start()
    router = Router(config, store=store, bus=bus, keys=Keys(cluster), router_id=router_id,
                    url=f"http://{config.host}:{port}")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watchdog = None
        if os.environ.get("FLEETWARD_LOOP_WATCHDOG"):
            from fleetward.migration.watchdog import LoopWatchdog

            watchdog = asyncio.create_task(LoopWatchdog(float(os.environ["FLEETWARD_LOOP_WATCHDOG"])).run())
        await router.start()  # whole state loaded before uvicorn binds the port
        if on_ready is not None:
            on_ready(router)
        log.info("router %s serving on %s", router.id, router.url)
        yield
        await router.aclose()
        if watchdog is not None:
            watchdog.cancel()

    app = router.app()
    app.router.lifespan_context = lifespan
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=port, loop="none", http="httptools",
                                           log_level="warning", access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=int(config.drain_timeout_s) or None))
    try:
        await server.serve()
    finally:
        await bus.aclose()
        await store.aclose()
