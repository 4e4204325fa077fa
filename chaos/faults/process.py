"""Process faults: kill, engine kill, hang, crash loop, slow start, OOM kill. Targets are workers.

=======================  ===============================================================================
fault                    what happens (sim: the simulated worker is one process; vLLM: API server →
                         ``VLLM::EngineCore`` → ``VLLM::Worker``)
=======================  ===============================================================================
``process.kill_worker``  SIGKILL the worker's whole tree (``scope: tree``) or its root only (``root``: on
                         vLLM the engine may outlive the API server a moment; recovery reaps it)
``process.kill_engine``  SIGKILL the engine only. vLLM: EngineCore (the API server is left to notice).
                         sim: its one process, so this is ``process.kill_worker`` there
``process.hang``         ``mode: silent``: the engine stops, ``/health`` stays 200 (vLLM: SIGSTOP of
                         EngineCore and its children; sim: the ``hang`` switch). ``mode: freeze``: SIGSTOP
                         of the whole tree, ``/health`` stops answering too (both backends).
                         ``mode: cgroup_freeze``: the engine processes are moved into a freezer cgroup
                         ``fleetward/<name>`` and frozen, a stop without a signal: nothing is in state T
                         (they sleep in the kernel, ``D``) and nothing can be caught, as with a hung kernel
                         or a collective that never returns. vLLM: EngineCore and its children, ``/health``
                         stays 200; sim: its one process, so ``/health`` stops answering too. Root, cgroup
                         v1 ``freezer`` (or v2 ``cgroup.freeze``); a SIGKILL takes effect only once thawed
``process.crash_loop``   from its next start on, the worker exits (``exit_code``) ``failures`` times,
                         ``delay_s`` after each start, before a start succeeds; the worker is killed so
                         that it must start again
``process.slow_start``   the worker is restarted and takes ``delay_s`` longer to become ready
``process.oom_kill``     the worker is restarted inside a memory cgroup of its own; the cgroup's limit is
                         set just above its usage and a helper in the same cgroup allocates past it, so the
                         kernel's OOM killer kills the worker (made the preferred victim with
                         ``oom_score_adj`` 1000) and nothing outside the cgroup. Root, cgroup v1 memory
                         controller (or v2 with memory enabled)
=======================  ===============================================================================

Recovery (``restart: true``) brings a dead worker back through the node agent unless something else (the
supervisor) already did; with ``restart: false`` recovery waits for the supervisor. Every fault records
what it did before it does the next thing, so recovery undoes exactly that, also after a half-failed
injection, and is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import psutil
from pydantic import Field

from fleetward.chaos.fault import FaultContext, Launcher
from fleetward.chaos.faults._base import (
    BaseFault,
    FaultParams,
    FaultUnavailable,
    ParamsT,
    catalogued,
    eventually,
    fleet_of,
    quietly,
    running_tree,
    service_of,
)
from fleetward.fleet.claims import claim, release
from fleetward.fleet.handle import Fleet
from fleetward.fleet.procs import ManagedProcess, kill_tree

if TYPE_CHECKING:
    import httpx

__all__ = ["CrashLoop", "FreezerGroup", "HangWorker", "KillEngine", "KillWorker", "MemoryGroup", "OomKill",
           "SlowStart", "launcher_prefix"]


def launcher_prefix(*, state: Path | None = None, fail: int = 0, exit_code: int = 1, delay: float = 0.0,
                    cgroup_procs: Path | None = None) -> list[str]:
    """The argv prefix that starts a worker through :mod:`fleetward.chaos.faults.launcher`."""
    argv = [sys.executable, "-m", "fleetward.chaos.faults.launcher"]
    if state is not None:
        argv += ["--state", str(state)]
    if fail:
        argv += ["--fail", str(fail), "--exit-code", str(exit_code)]
    if delay:
        argv += ["--delay", str(delay)]
    if cgroup_procs is not None:
        argv += ["--cgroup-procs", str(cgroup_procs)]
    return [*argv, "--"]


def _launcher(ctx: FaultContext) -> Launcher:
    launcher: Launcher = service_of(ctx, "launcher", "this fault restarts workers through a launcher: it needs a "
                                    "fleet the testbed started (TestFleet)")
    return launcher


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stopped(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


class _WorkerFault(BaseFault[ParamsT]):
    family = "process"

    def _resolve(self, ctx: FaultContext) -> Fleet:
        fleet = fleet_of(ctx)
        self.targets = ctx.resolve(self.target)
        return fleet

    async def _bring_back(self, fleet: Fleet, worker: str) -> None:
        """Restart ``worker`` unless it serves, or is being restarted (by the supervisor)."""
        await fleet.ensure_serving(worker, timeout=self.params.recover_timeout_s)

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        fleet = fleet_of(ctx)

        async def all_serving() -> bool:
            return all([await fleet.worker_serving(w, timeout=5) for w in self.targets])

        return await eventually(all_serving, self.params.recover_timeout_s, 0.2)


class KillParams(FaultParams):
    scope: Literal["tree", "root"] = Field("tree", description="SIGKILL the whole process tree, or the root only")
    restart: bool = Field(True, description="recovery restarts the worker unless the supervisor already did")


@catalogued("SIGKILL a worker (its whole process tree, or its root process only)")
class KillWorker(_WorkerFault[KillParams]):
    name = "process.kill_worker"
    params: KillParams

    def setup(self) -> None:
        self._killed: dict[str, list[psutil.Process]] = {}

    async def inject(self, ctx: FaultContext) -> None:
        fleet = self._resolve(ctx)
        for w in self.targets:
            tree = running_tree(fleet, w)
            self._killed[w] = tree
            if self.params.scope == "tree":
                fleet.kill(w)
            else:
                with contextlib.suppress(psutil.Error):
                    tree[0].send_signal(signal.SIGKILL)
        self.detail["pids"] = {w: [p.pid for p in t] for w, t in self._killed.items()}

    async def verify(self, ctx: FaultContext) -> bool:
        def gone() -> bool:
            return all(not _alive(tree[0]) and (self.params.scope == "root" or not any(_alive(p) for p in tree))
                       for tree in self._killed.values())

        return bool(self._killed) and await eventually(gone, self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        for w, tree in self._killed.items():
            kill_tree([p for p in tree if _alive(p)])  # what a root-only kill left behind
            if self.params.restart:
                await quietly(f"restart {w}", self._bring_back(fleet, w))


class KillEngineParams(FaultParams):
    restart: bool = Field(True, description="recovery restarts the worker unless the supervisor already did")


@catalogued("SIGKILL the engine process only (vLLM EngineCore; the sim's one process)")
class KillEngine(_WorkerFault[KillEngineParams]):
    name = "process.kill_engine"
    params: KillEngineParams

    def setup(self) -> None:
        self._engines: dict[str, list[psutil.Process]] = {}

    async def inject(self, ctx: FaultContext) -> None:
        fleet = self._resolve(ctx)
        for w in self.targets:
            running_tree(fleet, w)
            engines = fleet.engine_processes(w)
            self._engines[w] = engines
            kill_tree(engines, signal.SIGKILL)
        self.detail["engine_pids"] = {w: [p.pid for p in e] for w, e in self._engines.items()}

    async def verify(self, ctx: FaultContext) -> bool:
        return bool(self._engines) and await eventually(
            lambda: not any(_alive(p) for e in self._engines.values() for p in e), self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        if not self.params.restart:
            return
        fleet = fleet_of(ctx)
        for w in self._engines:
            await quietly(f"restart {w}", self._bring_back(fleet, w))


class HangParams(FaultParams):
    mode: Literal["silent", "freeze", "cgroup_freeze"] = Field(
        "silent", description="silent: the engine stops, /health stays 200; freeze: the whole tree stops; "
        "cgroup_freeze: the engine processes are frozen by the cgroup freezer (no signal, no T state; root)")


@catalogued("hang a worker: the engine stops (silent: /health still 200), the whole tree is SIGSTOPped, or the "
            "engine is frozen by the cgroup freezer (no signal)")
class HangWorker(_WorkerFault[HangParams]):
    name = "process.hang"
    params: HangParams

    def setup(self) -> None:
        self._stopped: dict[str, list[psutil.Process]] = {}
        self._groups: dict[str, FreezerGroup] = {}  # cgroup_freeze: each worker's freezer cgroup
        self._switched: list[str] = []
        self._urls: dict[str, str] = {}
        self._answering: set[str] = set()  # workers whose API server is not stopped: /health must say 200
        self._seen = False
        self._healthy_while_stopped: set[str] = set()

    async def inject(self, ctx: FaultContext) -> None:
        fleet = self._resolve(ctx)
        mode = self.params.mode
        if mode == "cgroup_freeze":
            reason = FreezerGroup.unavailable_reason()
            if reason:
                raise FaultUnavailable(f"process.hang mode cgroup_freeze: {reason}")
        import httpx

        # One client for the look at /health right after the stop, its connection opened before it: on a busy
        # host a fresh connection (and a 1-s budget) can lose the race with a supervisor that restarts the
        # worker as soon as it sees the stop, and a 200 not seen then is not seen at all.
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            await self._stop(fleet, client)
        self.detail["stopped_pids"] = {w: [p.pid for p in ps] for w, ps in self._stopped.items()}
        self.detail["switched"] = list(self._switched)
        if self._groups:
            self.detail["groups"] = {w: {"path": str(g.path)} for w, g in self._groups.items()}

    async def _stop(self, fleet: Fleet, client: httpx.AsyncClient) -> None:
        mode = self.params.mode
        for w in self.targets:
            tree = running_tree(fleet, w)
            self._urls[w] = fleet.bind_url(w)
            if mode != "freeze":
                await self._health(self._urls[w], client)  # the connection, opened while it still runs
            if mode == "silent" and fleet.backend.fault_switches:
                self._switched.append(w)
                await fleet.fault(w, hang=True)
                continue
            if mode in ("silent", "cgroup_freeze"):
                procs: list[psutil.Process] = []
                for e in fleet.engine_processes(w):
                    with contextlib.suppress(psutil.Error):
                        procs += [q for q in (e, *e.children(recursive=True)) if q not in procs]
            else:
                procs = tree
            self._stopped[w] = procs
            if tree[0] not in procs:
                self._answering.add(w)
            if mode == "cgroup_freeze":
                # Recorded before it acts, so that recovery thaws and removes whatever was done.
                group = self._groups[w] = FreezerGroup(f"hang-{w}-{uuid.uuid4().hex[:6]}")
                group.add([q.pid for q in procs])
                group.freeze()
            else:
                kill_tree(procs, signal.SIGSTOP)
        # Look once right away: a supervisor may restart a stopped worker soon after, and what was seen
        # stopped counts for verify.
        if self._stopped:
            self._seen = await eventually(self._all_stopped, 1.0, 0.01)
            if self._seen:
                # And /health at once, for the same reason: a supervisor that sees the stop (in a fraction of
                # a second) restarts the worker, and a restarting server answers nothing. A 200 counts when
                # the engine is still stopped after it.
                for w in self._answering:
                    if await self._health(self._urls[w], client) == 200 and self._all_stopped():
                        self._healthy_while_stopped.add(w)

    def _all_stopped(self) -> bool:
        if self.params.mode == "cgroup_freeze":
            return all(g.frozen() and {p.pid for p in self._stopped[w]} <= set(g.members())
                       for w, g in self._groups.items())
        return all(_stopped(p) for ps in self._stopped.values() for p in ps)

    async def _health(self, url: str, client: httpx.AsyncClient | None = None) -> int | None:
        """``url``'s /health status (None: no answer), on ``client`` when given, else on a client of its own."""
        import httpx

        try:
            if client is not None:
                return (await client.get(f"{url}/health")).status_code
            async with httpx.AsyncClient(timeout=1.0, trust_env=False) as own:
                return (await own.get(f"{url}/health")).status_code
        except (httpx.HTTPError, OSError):
            return None

    async def verify(self, ctx: FaultContext) -> bool:
        """Silent: the engine is stopped (the sim reports ``hung``; vLLM's engine processes are in state T)
        while ``/health`` still answers 200. Freeze: every process of the tree is in state T (so nothing
        answers). Cgroup freeze: the freezer cgroup reads frozen with every engine process in it, and where the
        API server is not one of them (vLLM), ``/health`` still answers 200. Only what the injection touched is
        looked at: a supervisor that restarts the worker meanwhile does not make an observed hang unobserved (a
        200 seen at injection while the engine was stopped counts), and a restart before the first look fails."""
        fleet = fleet_of(ctx)
        urls = {w: self._urls[w] for w in self.targets if w in self._answering or w in self._switched}

        async def hung() -> bool:
            for w in self._switched:
                if not (await fleet.state(w)).get("hung"):
                    return False
            if not self._seen and not self._all_stopped():
                return False
            if self.params.mode != "freeze":
                for w, url in urls.items():
                    if w not in self._healthy_while_stopped and await self._health(url) != 200:
                        return False  # a silent hang keeps answering /health
            return True

        return bool(self._stopped or self._switched) and await eventually(hung, self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        for w, group in self._groups.items():
            # Thawed first: a process the supervisor SIGKILLed meanwhile dies only now.
            if not await eventually(group.remove, self.params.recover_timeout_s, 0.05):
                self.detail.setdefault("errors", {})[w] = f"freezer cgroup {group.path} could not be removed"
        if self.params.mode != "cgroup_freeze":
            for ps in self._stopped.values():
                kill_tree(ps, signal.SIGCONT)
        for w in self._switched:
            await quietly(f"clear hang on {w}", fleet.fault(w, hang=False))


class CrashLoopParams(FaultParams):
    failures: int = Field(1000, ge=1, description="starts that fail before one succeeds (default: until recovered)")
    delay_s: float = Field(0.0, ge=0, description="how long each failing start lives before it exits")
    exit_code: int = Field(1, ge=1, le=255)
    probe_restart: bool = Field(True, description="without a supervisor controller, verify restarts the worker "
                                "itself once (to see it fail)")


@catalogued("the worker dies on every start (exits N times) until recovered; it is killed to make it start")
class CrashLoop(_WorkerFault[CrashLoopParams]):
    name = "process.crash_loop"
    params: CrashLoopParams

    def setup(self) -> None:
        self._state: dict[str, Path] = {}
        self._dir = Path(tempfile.mkdtemp(prefix="fleetward-crashloop-"))
        claim("folder", str(self._dir))  # a run killed before recover() leaves it to the next one's reclaim

    def starts(self, worker: str) -> int:
        """Failed or succeeded starts through the launcher since injection."""
        try:
            return int(self._state[worker].read_text() or "0")
        except (KeyError, FileNotFoundError, ValueError):
            return 0

    async def inject(self, ctx: FaultContext) -> None:
        fleet = self._resolve(ctx)
        launcher = _launcher(ctx)
        p = self.params
        for w in self.targets:
            self._state[w] = self._dir / f"{w}.starts"
            launcher.wrap_launch(w, launcher_prefix(state=self._state[w], fail=p.failures, exit_code=p.exit_code,
                                                    delay=p.delay_s))
            fleet.kill(w)

    async def verify(self, ctx: FaultContext) -> bool:
        fleet = fleet_of(ctx)
        if not self._state:
            return False
        if self.params.probe_restart and not fleet.supervised:
            # Nobody else restarts workers here (no supervisor controller): start it once to see it fail.
            for w in self.targets:
                if self.starts(w) == 0:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(fleet.restart(w), self.params.verify_timeout_s)
        ok = await eventually(lambda: all(self.starts(w) >= 1 for w in self._state), self.params.verify_timeout_s)
        self.detail["starts"] = {w: self.starts(w) for w in self._state}
        return ok and not any([await fleet.worker_serving(w, timeout=2) for w in self._state])

    async def recover(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        for w in self._state:
            _launcher(ctx).wrap_launch(w, None)
        self.detail["starts"] = {w: self.starts(w) for w in self._state}
        for w in self._state:
            await quietly(f"restart {w}", self._bring_back(fleet, w))
        for f in self._state.values():
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._dir.rmdir()
            release("folder", str(self._dir))


class SlowStartParams(FaultParams):
    delay_s: float = Field(5.0, gt=0, description="extra time before the worker's process really starts")


@catalogued("the worker is restarted and takes delay_s longer to become ready")
class SlowStart(_WorkerFault[SlowStartParams]):
    name = "process.slow_start"
    params: SlowStartParams

    def setup(self) -> None:
        self._restarts: dict[str, asyncio.Task[Any]] = {}
        self._old: dict[str, int | None] = {}

    async def inject(self, ctx: FaultContext) -> None:
        fleet = self._resolve(ctx)
        for w in self.targets:
            tree = fleet.processes(w)
            self._old[w] = tree[0].pid if tree else None
            _launcher(ctx).wrap_launch(w, launcher_prefix(delay=self.params.delay_s))
            # Owned by this fault: awaited (or cancelled) by recover.
            self._restarts[w] = asyncio.create_task(fleet.restart(w), name=f"slow-start-{w}")

    async def verify(self, ctx: FaultContext) -> bool:
        fleet = fleet_of(ctx)

        async def starting() -> bool:
            for w in self._restarts:
                tree = fleet.processes(w)
                if not tree or tree[0].pid == self._old[w]:
                    return False
                if await fleet.worker_serving(w, timeout=1):
                    return False
            return True

        return bool(self._restarts) and await eventually(starting, self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        launcher = _launcher(ctx)
        for w, task in self._restarts.items():
            try:
                await asyncio.wait_for(asyncio.shield(task), self.params.delay_s + self.params.recover_timeout_s)
            except asyncio.CancelledError:
                task.cancel()
                raise
            except Exception as exc:  # a start that failed or took too long: start it plainly
                task.cancel()
                self.detail.setdefault("errors", {})[w] = str(exc)
                launcher.wrap_launch(w, None)
                await quietly(f"restart {w}", self._bring_back(fleet, w))
            finally:
                launcher.wrap_launch(w, None)


# -- freezer ------------------------------------------------------------------------------------------------

_V1_FREEZER = Path("/sys/fs/cgroup/freezer")
_V2 = Path("/sys/fs/cgroup")


class FreezerGroup:
    """A freezer cgroup ``fleetward/<name>``: the v1 ``freezer`` hierarchy, or cgroup v2's ``cgroup.freeze``.

    Processes added are moved out of their own cgroup (remembered) and back by :meth:`remove`. Frozen
    processes use no CPU and sleep in the kernel (state ``D`` on v1); no signal is involved, so nothing in them
    can notice, and on v1 even a SIGKILL takes effect only once they are thawed.
    """

    def __init__(self, name: str) -> None:
        reason = self.unavailable_reason()
        if reason:
            raise FaultUnavailable(reason)
        if (_V1_FREEZER / "tasks").exists():
            self.version, self.root = 1, _V1_FREEZER
        else:
            self.version, self.root = 2, _V2
        self.path = self.root / "fleetward" / name
        claim("cgroup", str(self.path))  # a run killed while it is frozen leaves it to the next one's reclaim
        self.path.mkdir(parents=True, exist_ok=True)
        self._homes: dict[int, Path] = {}  # pid -> the cgroup it came from

    @staticmethod
    def unavailable_reason() -> str | None:
        if os.geteuid() != 0:
            return "the cgroup freezer needs root"
        if (_V1_FREEZER / "tasks").exists() and os.access(_V1_FREEZER, os.W_OK):
            return None
        if (_V2 / "cgroup.controllers").exists() and os.access(_V2, os.W_OK):
            return None  # every non-root v2 cgroup has cgroup.freeze
        return ("no cgroup freezer: neither a v1 freezer hierarchy at /sys/fs/cgroup/freezer nor a writable "
                "cgroup v2 hierarchy at /sys/fs/cgroup")

    def _home(self, pid: int) -> Path:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            if (self.version == 1 and "freezer" in controllers.split(",")) or (self.version == 2 and not controllers):
                return self.root / rel.lstrip("/")
        return self.root

    def add(self, pids: list[int]) -> None:
        """Move each process (all its threads) into the group; one that already exited is skipped."""
        for pid in pids:
            try:
                home = self._home(pid)
                (self.path / "cgroup.procs").write_text(str(pid))
            except (OSError, ValueError):
                continue
            self._homes.setdefault(pid, home)

    def freeze(self) -> None:
        if self.version == 1:
            (self.path / "freezer.state").write_text("FROZEN")
        else:
            (self.path / "cgroup.freeze").write_text("1")

    def thaw(self) -> None:
        if self.version == 1:
            (self.path / "freezer.state").write_text("THAWED")
        else:
            (self.path / "cgroup.freeze").write_text("0")

    def frozen(self) -> bool:
        """Every process of the group is frozen (v1 ``FREEZING`` is not yet: some are still running)."""
        try:
            if self.version == 1:
                return (self.path / "freezer.state").read_text().strip() == "FROZEN"
            return "frozen 1" in (self.path / "cgroup.events").read_text().splitlines()
        except OSError:
            return False

    def members(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def remove(self) -> bool:
        """Thaw, move every process back where it came from, delete the group. Idempotent; False while the
        group cannot be deleted yet (a process killed while frozen is still exiting)."""
        if not self.path.exists():
            release("cgroup", str(self.path))
            return True
        with contextlib.suppress(OSError):
            self.thaw()
        for pid in self.members():
            with contextlib.suppress(OSError):
                (self._homes.get(pid, self.root) / "cgroup.procs").write_text(str(pid))
        try:
            self.path.rmdir()
        except OSError:
            return False
        release("cgroup", str(self.path))
        return True


# -- memory -------------------------------------------------------------------------------------------------

_V1_MEMORY = Path("/sys/fs/cgroup/memory")


class MemoryGroup:
    """A memory cgroup ``fleetward/<name>`` (v1 ``memory`` controller, or v2 with ``memory`` enabled)."""

    def __init__(self, name: str) -> None:
        reason = self.unavailable_reason()
        if reason:
            raise FaultUnavailable(reason)
        if (_V1_MEMORY / "memory.limit_in_bytes").exists():
            self.version, root = 1, _V1_MEMORY
        else:
            self.version, root = 2, _V2
            with contextlib.suppress(OSError):
                (root / "cgroup.subtree_control").write_text("+memory")
                (root / "fleetward").mkdir(exist_ok=True)
                (root / "fleetward" / "cgroup.subtree_control").write_text("+memory")
        self.root = root
        self.path = root / "fleetward" / name
        claim("cgroup", str(self.path))  # a run killed before remove() leaves it to the next one's reclaim
        self.path.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def unavailable_reason() -> str | None:
        if os.geteuid() != 0:
            return "memory cgroups need root"
        if (_V1_MEMORY / "memory.limit_in_bytes").exists() and os.access(_V1_MEMORY, os.W_OK):
            return None
        controllers = _V2 / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            return None
        return "no memory cgroup controller is mounted (v1 memory, or v2 with memory)"

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def _file(self, v1: str, v2: str) -> Path:
        return self.path / (v1 if self.version == 1 else v2)

    def usage(self) -> int:
        return int(self._file("memory.usage_in_bytes", "memory.current").read_text())

    def anon(self) -> int:
        key = "rss" if self.version == 1 else "anon"
        for line in self._file("memory.stat", "memory.stat").read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
        return 0

    def limit(self, nbytes: int | None) -> None:
        if self.version == 1:
            (self.path / "memory.limit_in_bytes").write_text("-1" if nbytes is None else str(nbytes))
        else:
            (self.path / "memory.max").write_text("max" if nbytes is None else str(nbytes))

    def oom_kills(self) -> int:
        f = self._file("memory.oom_control", "memory.events")
        for line in f.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def members(self) -> list[int]:
        try:
            return [int(x) for x in self.procs.read_text().split()]
        except OSError:
            return []

    def remove(self) -> None:
        """Move what is left to the root group, lift the limit, delete the group (idempotent)."""
        if not self.path.exists():
            return
        with contextlib.suppress(OSError):
            self.limit(None)
        for pid in self.members():
            with contextlib.suppress(OSError):
                (self.root / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            self.path.rmdir()
        if not self.path.exists():
            release("cgroup", str(self.path))


def _oom_prefer(pid: int) -> None:
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/oom_score_adj").write_text("1000")


_BALLOON = """
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
held = []
for _ in range(int(sys.argv[2])):
    block = bytearray(1 << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    held.append(block)
print("FULL", flush=True)
while True:
    time.sleep(3600)
"""


class OomParams(FaultParams):
    headroom_mb: int = Field(16, ge=1, le=1024, description="the limit is the worker's usage plus this")
    restart: bool = Field(True, description="recovery restarts the worker unless the supervisor already did")


@catalogued("OOM kill: the worker runs under a small memory cgroup limit and the kernel's OOM killer kills it",
            needs_root=True)
class OomKill(_WorkerFault[OomParams]):
    name = "process.oom_kill"
    params: OomParams

    def setup(self) -> None:
        self._groups: dict[str, MemoryGroup] = {}
        self._balloons: dict[str, ManagedProcess] = {}
        self._trees: dict[str, list[psutil.Process]] = {}

    async def inject(self, ctx: FaultContext) -> None:
        fleet = self._resolve(ctx)
        launcher = _launcher(ctx)
        for w in self.targets:
            group = self._groups[w] = MemoryGroup(f"oom-{w}-{uuid.uuid4().hex[:6]}")
            launcher.wrap_launch(w, launcher_prefix(cgroup_procs=group.procs))
            try:
                await asyncio.wait_for(fleet.restart(w), self.params.recover_timeout_s)
            finally:
                launcher.wrap_launch(w, None)
            self._trees[w] = running_tree(fleet, w)
            for p in self._trees[w]:  # the preferred victim: nothing else in the group is picked first
                _oom_prefer(p.pid)
            usage, anon = group.usage(), group.anon()
            mb = 1 << 20
            group.limit(usage + self.params.headroom_mb * mb)
            # The helper fits under the limit alone (once the worker's memory is freed), not beside the worker.
            balloon_mb = self.params.headroom_mb + max(1, int(anon * 0.8) // mb)
            self.detail.setdefault("groups", {})[w] = {"path": str(group.path), "usage": usage, "anon": anon,
                                                       "balloon_mb": balloon_mb}
            self._balloons[w] = ManagedProcess(
                f"oom-balloon {w}", [sys.executable, "-c", _BALLOON, str(group.procs), str(balloon_mb)],
                log_path=launcher.log_dir / f"oom-balloon-{w}.log").start()

    async def verify(self, ctx: FaultContext) -> bool:
        def killed() -> bool:  # by the kernel: the group counted an OOM kill, and a process of the worker is gone
            return all(self._groups[w].oom_kills() >= 1 and any(not _alive(p) for p in self._trees[w])
                       for w in self._trees)

        ok = bool(self._trees) and await eventually(killed, self.params.verify_timeout_s)
        self.detail["oom_kills"] = {w: g.oom_kills() for w, g in self._groups.items()}
        self.detail["killed_pids"] = {w: [p.pid for p in t if not _alive(p)] for w, t in self._trees.items()}
        return ok

    async def recover(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        for w in self._groups:
            _launcher(ctx).wrap_launch(w, None)
        for w, balloon in self._balloons.items():
            await quietly(f"stop the balloon of {w}", balloon.stop(grace=1))
        for w, tree in self._trees.items():
            if _alive(tree[0]) and [p.pid for p in fleet.processes(w)[:1]] == [tree[0].pid]:
                fleet.kill(w)  # the worker outlived its OOM: it still runs in the group about to go
        for group in self._groups.values():
            group.remove()
        if self.params.restart:
            for w in self._groups:
                await quietly(f"restart {w}", self._bring_back(fleet, w))
