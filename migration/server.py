"""Running a router as a process: state store, event bus, the app, uvicorn, ordered shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import Access, RouterConfig, admin_token_given
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import listening_socket
from fleetward.migration.downstream import ClientConnection
from fleetward.migration.http import router_app
from fleetward.migration.router import Router

__all__ = ["serve_router"]

log = logging.getLogger(__name__)


async def serve_router(config: RouterConfig, *, etcd: str, mqtt: str, cluster: str, router_id: str | None = None,
                       on_ready: Callable[[Router], None] | None = None, reuse_port: bool = False,
                       etcd_access: Access | None = None, mqtt_access: Access | None = None) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn's handlers), then drain, deregister and close.

    ``reuse_port``: one of several router processes on one port (``routing.processes``): the port is
    bound with ``SO_REUSEPORT``, so the kernel spreads connections over the processes, and each process
    also listens on a port of its own, the address it registers (its metrics, its stream progress).
    """
    # Starlette imports anyio's asyncio backend on the first streaming response; under CPU pressure that
    # import alone blocked the loop for seconds (long enough to look like a stall). Import it now.
    importlib.import_module("anyio._backends._asyncio")
    # Listening before the router registers its address, so a peer that reads it is not refused
    # (fleet.procs.listening_socket); connections wait in the backlog until the state is whole.
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(listening_socket(config.host, 0 if reuse_port else config.port,
                                                       name="router"))]
        if reuse_port:
            sockets.append(held.enter_context(listening_socket(config.host, config.port, name="router",
                                                               reuse_port=True)))
        await _serve(config, sockets, etcd=etcd, mqtt=mqtt, cluster=cluster, router_id=router_id,
                     on_ready=on_ready, public=reuse_port, etcd_access=etcd_access, mqtt_access=mqtt_access)


async def _serve(config: RouterConfig, sockets: list[socket.socket], *, etcd: str, mqtt: str, cluster: str,
                 router_id: str | None, on_ready: Callable[[Router], None] | None, public: bool,
                 etcd_access: Access | None, mqtt_access: Access | None) -> None:
    port = sockets[0].getsockname()[1]
    store = EtcdStore(etcd, access=etcd_access)
    await store.get(Keys(cluster).root)  # a clear StoreUnavailable now rather than later
    bus = await MqttBus(mqtt, cluster, access=mqtt_access).start()
    given = admin_token_given()
    router = Router(config, store=store, bus=bus, keys=Keys(cluster), router_id=router_id,
                    admin_token=given.get_secret_value() if given is not None else None,
                    url=f"http://{config.host}:{port}",
                    public_url=f"http://{config.host}:{config.port}" if public else None)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watchdog = None
        if os.environ.get("FLEETWARD_LOOP_WATCHDOG"):
            from fleetward.migration.watchdog import LoopWatchdog

            watchdog = asyncio.create_task(LoopWatchdog(float(os.environ["FLEETWARD_LOOP_WATCHDOG"])).run())
        await router.start()  # whole state loaded before uvicorn accepts a connection
        if on_ready is not None:
            on_ready(router)
        log.info("router %s serving on %s", router.id, router.url)
        yield
        await router.aclose()
        if watchdog is not None:
            watchdog.cancel()

    app = router_app(router)
    app.router.lifespan_context = lifespan
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=port, loop="none", http=ClientConnection,
                                           log_level="warning", access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=int(config.drain_timeout_s) or None))
    try:
        await server.serve(sockets=sockets)
    finally:
        await bus.aclose()
        await store.aclose()


async def serve_router_group(config: RouterConfig, child_argv: Callable[[str, int], list[str]], *,
                             router_id: str | None = None, on_ready: Callable[[str, str], None] | None = None,
                             restart_backoff_s: float = 1.0) -> int:
    """``routing.processes`` routers on one port, each a process of its own (one event loop is one core).

    Each child is ``child_argv(its id, port)``: a whole router (its own id ``<id>-<k>``, etcd lease,
    checkpoints), started with ``--reuse-port``; the kernel spreads connections over them. They share
    state through etcd as any replicas do, so a client that resumes with ``Last-Event-ID`` on another
    process of the group is served from the checkpoint. A child that dies is started again (backoff
    doubling from ``restart_backoff_s`` to 30 s); SIGTERM or SIGINT stops them all (they drain first), and
    a SIGKILLed group leaves nothing behind (the children die with this process, ``PR_SET_PDEATHSIG``).
    Returns the exit code: 0 after a signal.
    """
    import signal

    from fleetward.fleet.procs import dies_with_parent, free_port

    port = config.port or free_port(config.host)
    # Held (bound with SO_REUSEPORT, never listening, so it takes no connection) while the group runs:
    # nothing else takes the port between a child's death and its restart.
    hold = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        hold.bind((config.host, port))
    except OSError as exc:
        hold.close()
        raise OSError(f"router: cannot bind {config.host}:{port}: {exc.strerror}") from exc
    base = router_id or f"router-{os.urandom(4).hex()}"
    ids = [f"{base}-{k}" for k in range(config.processes)]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    ready: dict[str, asyncio.Event] = {rid: asyncio.Event() for rid in ids}
    procs: dict[str, asyncio.subprocess.Process] = {}

    async def run(rid: str) -> None:
        backoff = restart_backoff_s
        while not stopping.is_set():
            started = loop.time()
            proc = procs[rid] = await asyncio.create_subprocess_exec(
                *child_argv(rid, port), stdout=asyncio.subprocess.PIPE, stderr=None, stdin=asyncio.subprocess.DEVNULL,
                preexec_fn=dies_with_parent())
            assert proc.stdout is not None
            async for line in proc.stdout:
                if line.startswith(b"READY "):
                    ready[rid].set()
                else:
                    os.write(1, line)
            code = await proc.wait()
            if stopping.is_set():
                return
            if loop.time() - started > 60:
                backoff = restart_backoff_s
            log.warning("router %s (pid %d) exited with code %s; starting it again in %.1f s", rid, proc.pid, code,
                        backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), backoff)
            backoff = min(30.0, backoff * 2)

    tasks = [asyncio.create_task(run(rid), name=f"router-group-{rid}") for rid in ids]
    all_ready: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*(e.wait() for e in ready.values())))
    stop: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({all_ready, stop}, return_when=asyncio.FIRST_COMPLETED)
        if all_ready.done() and on_ready is not None:
            on_ready(base, f"http://{config.host}:{port}")
        await stop
    finally:
        all_ready.cancel()
        stopping.set()
        for proc in procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        grace = config.drain_timeout_s + 10
        for proc in procs.values():
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        hold.close()
    return 0
