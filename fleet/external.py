"""Servers fleetward did not start: the backend of an adopted worker.

An adopted worker is a vLLM (or any OpenAI-compatible, vLLM-metric) server that someone else runs, given
by URL in the fleet file (``attach:``) or at run time (``fleetward worker add``). :class:`ExternalBackend`
is its :class:`~fleetward.fleet.backends.Backend`, one per server, built from its
:class:`~fleetward.fleet.config.AttachConfig`:

- :meth:`~ExternalBackend.adopt` starts nothing: it finds the server's process (a pidfile, a systemd unit,
  a container, a match over command lines; or none, for a server known by URL only) so the node agent can
  watch it like its own;
- :meth:`~ExternalBackend.launch` is a *restart*: it runs the operator's ``restart_command`` and waits for
  the new process; with ``restart_by_exit`` it runs nothing and waits for what runs the server (the kubelet,
  a container's restart policy) to start it again once its tree was cleared. Without either it refuses
  (:attr:`~ExternalBackend.can_restart` is False): the worker is drained and left for an operator, never
  killed blindly;
- :meth:`~ExternalBackend.stop` clears the old process tree before a restart (what a killed API server left
  behind would hold the port, the memory, on a GPU its memory), and only then; an agent that stops or
  gives a server up leaves it running (:attr:`~ExternalBackend.owns_processes` is False).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from fleetward.fleet.backends import WorkerHandle, wait_serving
from fleetward.fleet.config import AttachConfig
from fleetward.fleet.errors import FleetwardError, ProcessError
from fleetward.fleet.procs import (
    RUN_MARK,
    AdoptedProcess,
    ManagedProcess,
    pid_matching,
    pid_of_container,
    pid_of_pidfile,
    pid_of_unit,
)
from fleetward.fleet.worker import WorkerSpec

__all__ = ["ExternalBackend", "LeftForOperator", "discover"]


class LeftForOperator(FleetwardError):
    """A server fleetward did not start failed, and nobody said how to restart it: an operator must."""


async def discover(url: str, *, timeout: float = 5.0) -> tuple[str, str | None] | None:
    """The first model ``/v1/models`` lists and its tokenizer here, or None when the server does not answer.

    vLLM reports the folder it loaded as the model's ``root``: when that folder is on this host and holds a
    ``tokenizer.json``, it is the server's tokenizer.
    """
    try:
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            r = await client.get(f"{url.rstrip('/')}/v1/models")
            data = r.json().get("data") or []
            if r.status_code != 200 or not data:
                return None
            first = data[0]
            root = first.get("root")
            local = isinstance(root, str) and Path(root).is_absolute() and (Path(root) / "tokenizer.json").is_file()
            return str(first["id"]), root if local else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, AttributeError):
        return None


class ExternalBackend:
    """The backend of one adopted server (see the module docstring)."""

    name = "external"
    capabilities: frozenset[str] = frozenset()
    owns_processes = False  # never stopped when the agent stops or gives the server up
    simulated = False  # whatever it runs, fleetward does not model it
    start_timeout = 300.0

    def __init__(self, entry: AttachConfig, *, model: str, tokenizer: str | None = None) -> None:
        self.entry = entry
        self._model = model
        self.tokenizer = entry.tokenizer or tokenizer

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def max_model_len(self) -> int:
        return 0  # not known: the server was configured by someone else

    @property
    def fault_switches(self) -> bool:
        return False

    @property
    def can_restart(self) -> bool:
        return bool(self.entry.restart_command) or self.entry.restart_by_exit

    def reference(self) -> dict[str, Any] | None:
        return None

    def tiny_model(self) -> None:
        return None  # it serves what its owner started it with

    def check(self) -> None:
        return None

    def locator(self) -> Callable[[], int | None] | None:
        """How the server's process is found, or None (known by URL only)."""
        ref = self.entry.process
        if ref is None:
            return None
        if ref.pidfile is not None:
            pidfile = ref.pidfile
            return lambda: pid_of_pidfile(pidfile)
        if ref.systemd_unit is not None:
            unit = ref.systemd_unit
            return lambda: pid_of_unit(unit)
        if ref.match is not None:
            pattern = ref.match
            return lambda: pid_matching(pattern)
        assert ref.container is not None
        container = ref.container
        return lambda: pid_of_container(container)

    def adopt(self, spec: WorkerSpec) -> WorkerHandle:
        """A handle on the running server, its process found if it has a locator; nothing is started."""
        return WorkerHandle(spec, self.name, AdoptedProcess(f"worker {spec.id}", self.locator()))

    def launch(self, spec: WorkerSpec, log_dir: Path, env: Mapping[str, str] | None = None, *,
               prefix: Sequence[str] = ()) -> WorkerHandle:
        """Restart the server with the operator's command (in the background; :meth:`wait_ready` waits for
        it to finish, then for the new process to serve). :class:`LeftForOperator` without a command."""
        if not self.can_restart:
            raise LeftForOperator(f"{spec.id} ({self.entry.url}) is a server fleetward did not start and its "
                                  "attach entry has no restart_command: it is drained and left for an operator")
        if self.entry.restart_by_exit:
            # Its tree was cleared (stop): what runs it starts it again; wait_ready finds the new process.
            return self.adopt(spec)
        argv = [*prefix, *self.entry.restart_command]
        # Not marked as this run's: the server it starts is the operator's, and outlives us.
        command = ManagedProcess(f"restart command of {spec.id}", argv, log_path=log_dir / f"restart-{spec.id}.log",
                                 env=env, unset=(RUN_MARK,))
        command.start()
        return WorkerHandle(spec, self.name, _Restarting(self.adopt(spec), command))

    async def wait_ready(self, handle: WorkerHandle, *, timeout: float | None = None) -> None:
        process = handle.process
        if isinstance(process, _Restarting):
            await process.command_done(timeout or self.start_timeout)
            handle.process = process.adopted.process
        await wait_serving(handle, timeout=timeout or self.start_timeout, interval=0.5)

    async def warm_up(self, url: str) -> None:
        return None

    async def stop(self, handle: WorkerHandle, *, grace: float = 10.0) -> None:
        """Clear the old tree before a restart: only when there is a restart command to bring it back."""
        if self.can_restart:
            await handle.process.stop(grace)


class _Restarting:
    """The restart command of an adopted server, until it finished; then the server's own process."""

    def __init__(self, adopted: WorkerHandle, command: ManagedProcess) -> None:
        self.adopted = adopted
        self.command = command
        self.name = command.name
        self.survivors: list[Any] = []

    async def command_done(self, timeout: float) -> None:
        try:
            code = await asyncio.wait_for(self.command.wait_exit(), timeout)
        except TimeoutError:
            await self.command.stop(grace=2)
            raise ProcessError(f"{self.name} did not finish within {timeout:.0f}s; log {self.command.log_path}:\n"
                               f"{self.command.log_tail()}", name=self.name) from None
        if code != 0:
            raise ProcessError(f"{self.name} exited with code {code}; log {self.command.log_path}:\n"
                               f"{self.command.log_tail()}", name=self.name, exit_code=code,
                               log_tail=self.command.log_tail())

    # While the command runs, the worker has no process of its own yet.
    pid = None
    is_running = True

    def tree(self) -> list[Any]:
        return []

    def leftovers(self) -> list[Any]:
        return []

    def kill(self) -> None:
        self.command.kill()

    def signal(self, sig: int) -> None:
        self.command.signal(sig)

    async def wait_exit(self) -> int | None:
        await asyncio.Event().wait()
        return None

    async def wait_ready(self, ready: Any, *, timeout: float, interval: float = 0.1,
                         progress_cap: float | None = None) -> None:
        await self.command_done(timeout)

    async def stop(self, grace: float = 5.0) -> int | None:
        return await self.command.stop(grace)

    def log_tail(self, lines: int = 30) -> str:
        return self.command.log_tail(lines)

