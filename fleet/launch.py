"""Starting fleetward's own services as processes: their command lines, readiness, and who leads.

Every part of fleetward that starts a router, a supervisor controller or a node agent (``fleetward up``,
the test harness, the chaos runner, the benchmarks) builds its command line here and waits for it here,
so a flag is added in one place:

- :func:`router_argv`, :func:`controller_argv`, :func:`autoscaler_argv`, :func:`agent_argv`:
  ``python -m fleetward.cli ...`` with
  the cluster's etcd, broker and name; settings beyond the flags go in a fleet YAML file
  (:func:`write_service_config`);
- :func:`start_service`: start one and wait until its ``GET /health`` answers 200 (raises
  :class:`~fleetward.fleet.errors.ProcessError` with the log tail when it exits or times out first);
  :func:`restart_service` starts a killed one again on the same port;
- :func:`wait_leader`: wait until some controller (or a given one) leads the supervisor;
- :func:`serve_app`: the other side, inside such a process: serve its HTTP app while its main task runs.

Secrets never go on a command line: the admin token is passed in the environment
(``FLEETWARD_ADMIN_TOKEN``, :func:`service_env`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic import BaseModel

from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import ManagedProcess
from fleetward.fleet.registry import Leader, read_leader

__all__ = [
    "ServiceProcess",
    "agent_argv",
    "autoscaler_argv",
    "controller_argv",
    "fleetward_argv",
    "restart_service",
    "router_argv",
    "serve_app",
    "service_env",
    "start_service",
    "wait_healthy",
    "wait_leader",
    "write_service_config",
]


@dataclass
class ServiceProcess:
    """A fleetward service started as a process: its id, its HTTP URL and the process.

    ``client_url`` is where clients reach it (a fault proxy in front of a router, or ``url``).
    """

    id: str
    url: str
    process: ManagedProcess
    client_url: str = ""

    def __post_init__(self) -> None:
        self.client_url = self.client_url or self.url

    @property
    def is_running(self) -> bool:
        return self.process.is_running


def fleetward_argv(*args: str) -> list[str]:
    """``fleetward ARGS`` run by this interpreter (the venv's fleetward, whatever ``PATH`` says)."""
    return [sys.executable, "-m", "fleetward.cli", *args]


def _common(etcd: str, mqtt: str, cluster: str, config: Path | None) -> list[str]:
    return [*(["--config", str(config)] if config is not None else []), "--etcd", etcd, "--mqtt", mqtt,
            "--cluster", cluster]


def _bind(host: str | None, port: int | None) -> list[str]:
    return [*(["--host", host] if host else []), *(["--port", str(port)] if port else [])]


def router_argv(*, etcd: str, mqtt: str, cluster: str, config: Path | None = None, host: str | None = None,
                port: int | None = None, router_id: str | None = None) -> list[str]:
    """``fleetward router``: the config file's ``routing:`` section configures it."""
    return fleetward_argv("router", *_common(etcd, mqtt, cluster, config), *_bind(host, port),
                          *(["--id", router_id] if router_id else []))


def controller_argv(*, etcd: str, mqtt: str, cluster: str, config: Path | None = None, host: str | None = None,
                    port: int | None = None, controller_id: str | None = None) -> list[str]:
    """``fleetward supervisor --role controller``: the config file's ``supervisor:`` section configures it
    (its control API port too, unless ``port`` is given)."""
    return fleetward_argv("supervisor", "--role", "controller", *_common(etcd, mqtt, cluster, config),
                          *_bind(host, port), *(["--id", controller_id] if controller_id else []))


def autoscaler_argv(*, etcd: str, mqtt: str, cluster: str, config: Path | None = None, host: str | None = None,
                    port: int | None = None, autoscaler_id: str | None = None) -> list[str]:
    """``fleetward autoscaler``: the config file's ``autoscale:`` section (and ``backend``/``sim`` for its
    capacity model) configures it."""
    return fleetward_argv("autoscaler", *_common(etcd, mqtt, cluster, config), *_bind(host, port),
                          *(["--id", autoscaler_id] if autoscaler_id else []))


def agent_argv(*, etcd: str, mqtt: str, cluster: str, config: Path | None = None, workers: int | None = None,
               node: str | None = None, run_dir: Path | None = None, lease_ttl_s: int | None = None) -> list[str]:
    """``fleetward supervisor --role agent``: one node's agent, starting ``workers`` workers."""
    return fleetward_argv("supervisor", "--role", "agent", *_common(etcd, mqtt, cluster, config),
                          *(["--workers", str(workers)] if workers is not None else []),
                          *(["--node", node] if node else []),
                          *(["--run-dir", str(run_dir)] if run_dir is not None else []),
                          *(["--lease-ttl", str(lease_ttl_s)] if lease_ttl_s is not None else []))


def service_env(*, admin_token: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a fleetward service process: unbuffered, no script folder on the path, this
    process's log level, the admin token when given."""
    env = {"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
    if "FLEETWARD_LOG_LEVEL" in os.environ:
        env["FLEETWARD_LOG_LEVEL"] = os.environ["FLEETWARD_LOG_LEVEL"]
    if admin_token:
        env["FLEETWARD_ADMIN_TOKEN"] = admin_token
    return {**env, **extra}


def write_service_config(path: Path, *, cluster: str, **sections: BaseModel | str | None) -> Path:
    """A fleet YAML file with ``cluster`` and the given sections (``routing=``, ``supervisor=``) or plain
    values (``backend="sim"``)."""
    body: dict[str, Any] = {"cluster": cluster}
    body.update({name: model.model_dump(mode="json") if isinstance(model, BaseModel) else model
                 for name, model in sections.items() if model is not None})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(body))
    return path


async def wait_healthy(process: ManagedProcess, url: str, *, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Until ``url``/health answers 200; :class:`~fleetward.fleet.errors.ProcessError` if the process exits
    or the deadline passes first."""
    async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
        async def healthy() -> bool:
            return (await client.get(f"{url}/health")).status_code == 200

        await process.wait_ready(healthy, timeout=timeout, interval=interval)


async def start_service(service_id: str, argv: list[str], *, url: str, log_path: Path,
                        env: dict[str, str] | None = None, timeout: float = 30.0, interval: float = 0.05,
                        client_url: str = "") -> ServiceProcess:
    """Start ``argv`` and return once ``url``/health answers 200 (the process is stopped if it never does)."""
    proc = ManagedProcess(service_id, argv, log_path=log_path, env=env if env is not None else service_env())
    proc.start()
    try:
        await wait_healthy(proc, url, timeout=timeout, interval=interval)
    except BaseException:
        await proc.stop(grace=2)
        raise
    return ServiceProcess(service_id, url, proc, client_url)


async def restart_service(service: ServiceProcess, *, timeout: float = 30.0) -> ServiceProcess:
    """Start a killed (or running: it is killed first) service again with the same command line and port."""
    if service.process.is_running:
        service.process.kill()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(service.process.wait_exit(), 5)
    service.process.start()
    await wait_healthy(service.process, service.url, timeout=timeout)
    return service


async def wait_leader(store: StateStore, keys: Keys, *, timeout: float = 30.0, leader_id: str | None = None,
                      interval: float = 0.05) -> Leader:
    """Until some controller leads the supervisor (or ``leader_id`` does); its id and control API URL."""
    async with asyncio.timeout(timeout):
        while True:
            leader = await read_leader(store, keys)
            if leader is not None and leader_id in (None, leader.id):
                return leader
            await asyncio.sleep(interval)


async def serve_app(app: Any, *, sock: socket.socket, main: Callable[[], Coroutine[Any, Any, None]], name: str,
                    on_ready: Callable[[], None] | None = None) -> None:
    """Serve ``app`` (a FastAPI app) with uvicorn on ``sock`` (:func:`~fleetward.fleet.procs.listening_socket`,
    bound before ``main`` advertises the address) until SIGTERM, running ``main()`` as a task from start-up to
    shutdown (a controller's or an autoscaler's campaign-and-lead loop). ``on_ready`` is called once both run
    (a process says ``READY`` there). The socket is closed when it returns."""
    import uvicorn

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        task = asyncio.create_task(main(), name=name)
        if on_ready is not None:
            on_ready()
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.router.lifespan_context = lifespan
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, loop="none", log_level="warning",
                                           access_log=False, lifespan="on"))
    with sock:
        await server.serve(sockets=[sock])
