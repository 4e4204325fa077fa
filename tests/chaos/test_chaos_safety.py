"""Chaos safety (issue 16): the blast radius, ``chaos run --dry-run``, and consent for a fleet the run did not start.

The fleets are real: simulated workers as processes under a real node agent and supervisor, on the
session's etcd and Mosquitto. A test double here, ``process.test_collateral_drain``, drains its target and,
as collateral damage, other workers, through the supervisor's control API: they stay out of routing until
it recovers, which makes a breach of the radius at run time deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chaos_doubles import attachable
from pydantic import Field

from fleetward.chaos.experiment import DEFAULT_RADIUS
from fleetward.chaos.fault import CATALOGUE, FaultContext, FaultSpec, Target, register
from fleetward.chaos.faults._base import eventually
from fleetward.chaos.provision import on_node
from fleetward.chaos.radius import capacity_breach, out_of_service
from fleetward.chaos.runner import Runner, RunOptions
from fleetward.chaos.validation import load_experiment, validate_experiment
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import Frozen, SimConfig
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.registry import FleetSnapshot, read_fleet
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerRecord

LIBRARY = Path(__file__).resolve().parents[2] / "chaos" / "experiments"
SIM = {"decode_step_ms": 3, "decode_ms_per_seq": 0.05, "prefill_ms_per_token": 0.01, "seed": 11}


# -- the collateral double ------------------------------------------------------------------------------------


class CollateralParams(Frozen):
    collateral: tuple[str, ...] = Field((), description="workers it takes out of routing besides its target")


class CollateralDrain:
    """Drains (cordons) its target and its collateral through the supervisor; recovery takes them back."""

    name = "process.test_collateral_drain"
    family = "process"

    def __init__(self, params: CollateralParams, target: Target) -> None:
        self.params, self.target, self.targets = params, target, list[str]()

    def _all(self) -> list[str]:
        return [*self.targets, *self.params.collateral]

    async def _routable(self, ctx: FaultContext) -> set[str]:
        assert ctx.fleet is not None
        return {w.id for w in (await read_fleet(ctx.fleet.store, ctx.fleet.keys)).routable()}

    async def inject(self, ctx: FaultContext) -> None:
        assert ctx.fleet is not None
        self.targets = ctx.resolve(self.target)
        for w in self._all():
            (await ctx.fleet.supervisor_command(w, "drain", {"deadline_s": 1})).raise_for_status()

    async def verify(self, ctx: FaultContext) -> bool:
        async def out() -> bool:
            return not set(self._all()) & await self._routable(ctx)

        return await eventually(out, 20.0, 0.05)

    async def recover(self, ctx: FaultContext) -> None:
        assert ctx.fleet is not None
        for w in self._all():
            (await ctx.fleet.supervisor_command(w, "undrain")).raise_for_status()

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        async def back() -> bool:
            return set(self._all()) <= await self._routable(ctx)

        return await eventually(back, 30.0, 0.05)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "targets": self.targets, "collateral": list(self.params.collateral)}


if CollateralDrain.name not in CATALOGUE:
    register(FaultSpec(CollateralDrain.name, "process", "test double: drains its target and other workers",
                       CollateralParams, CollateralDrain, extra={"target": "worker"}))  # type: ignore[arg-type]


# -- helpers --------------------------------------------------------------------------------------------------


def experiment(**over: Any) -> dict[str, Any]:
    exp: dict[str, Any] = {
        "title": "hang one worker",
        "seed": 7,
        "fleet": {"workers": 2, "sim": SIM},
        "workload": {"duration_s": 2.0, "arrival": {"kind": "constant", "rate": 4}, "isl": 16, "osl": 16,
                     "drain_s": 15},
        "method": [{"name": "hang", "fault": "process.hang", "at": 0.5, "duration": 1.0,
                    "target": {"kind": "worker", "ids": ["node-w1"]}}],
        "blast_radius": {"workers": ["node-w1"], "max_capacity_share": 0.5},
        "checkers": ["fault_verification"],
    }
    exp.update(over)
    return exp


def chaos(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetward.cli", "chaos", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def env_without_token() -> dict[str, str]:
    return {k: v for k, v in {**os.environ, "PYTHONSAFEPATH": "1"}.items() if k != "FLEETWARD_ADMIN_TOKEN"}


@contextlib.asynccontextmanager
async def fault_events(fleet: Any) -> AsyncIterator[list[str]]:
    """The kinds of the ``fault.*`` events published on the fleet's cluster while the block runs; on leaving,
    a sentinel published after the block is awaited, so every earlier event has arrived."""
    seen: list[str] = []
    sentinel = asyncio.Event()
    subscribed = asyncio.Event()
    subscriber = MqttBus(fleet.mqtt_endpoint, fleet.cluster)

    async def record() -> None:
        async for ev in subscriber.subscribe(("#",), subscribed=subscribed):
            if ev.kind == "test.sentinel":
                sentinel.set()
            elif ev.kind.startswith("fault."):
                seen.append(ev.kind)

    task = asyncio.create_task(record())
    try:
        async with asyncio.timeout(15):
            await subscribed.wait()
        yield seen
        await fleet.bus.publish("test.sentinel")
        async with asyncio.timeout(15):
            await sentinel.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def nothing_hung(fleet: Any) -> bool:
    return not any([(await fleet.state(w))["hung"] for w in fleet.worker_ids])


# -- the blast radius in the experiment file -------------------------------------------------------------------


def test_a_target_outside_the_blast_radius_is_refused_with_file_line_fault_and_target(tmp_path: Path) -> None:
    path = tmp_path / "outside.yaml"
    path.write_text("title: outside\nfleet: {workers: 2}\nworkload: {duration_s: 2}\nmethod:\n"
                    "  - fault: process.hang\n    at: 0.5\n    target: {kind: worker, ids: [node-w0]}\n"
                    "blast_radius: {workers: [node-w1]}\n")
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    err = info.value
    assert (err.file, err.line, err.field) == (str(path), 7, "method[0].target.ids")  # the target's line
    assert "process.hang would hit node-w0, outside the blast radius (workers node-w1" in err.problem

    # A pick chooses inside the radius only: asking for more than it holds is refused the same way.
    picks = experiment(method=[{"fault": "process.hang", "at": 0.5, "target": {"kind": "worker", "count": 2}}])
    with pytest.raises(ConfigError, match=r"method\[0\].target.count: process.hang picks 2 worker\(s\); only 1 "
                       r"\(node-w1\) are inside the blast radius"):
        validate_experiment(picks)
    # A kind the radius does not list may not be faulted at all.
    router = experiment(method=[{"fault": "control.router_restart", "at": 0.5,
                                 "target": {"kind": "router", "ids": ["router-0"]}}])
    with pytest.raises(ConfigError, match=r"control\.router_restart would hit router-0, outside the blast radius"):
        validate_experiment(router)
    # A worker is inside when its node is listed.
    assert validate_experiment(experiment(blast_radius={"nodes": ["node"]})).radius().nodes == ("node",)
    # Its own faults, at once, may not take down more of the workers than max_capacity_share.
    both = experiment(fleet={"workers": 3}, blast_radius={"workers": ["node-w*"], "max_capacity_share": 0.4}, method=[
        {"fault": "process.hang", "at": 0.5, "duration": 1, "target": {"kind": "worker", "ids": ["node-w0"]}},
        {"fault": "process.hang", "at": 1.0, "duration": 1, "target": {"kind": "worker", "ids": ["node-w1"]}}])
    with pytest.raises(ConfigError, match=r"method\[1\].target: would fault 2 of 3 worker\(s\) at once .* over "
                       "the blast radius's max_capacity_share 0.4"):
        validate_experiment(both)


def test_without_a_declared_radius_an_experiment_may_break_the_fleet_it_declares_and_the_library_declares_one(
        ) -> None:
    exp = validate_experiment(experiment(blast_radius=None))
    assert exp.blast_radius is None and exp.radius() == DEFAULT_RADIUS
    assert DEFAULT_RADIUS.admits("worker", "node-w0") and DEFAULT_RADIUS.admits("etcd", "etcd-2")
    assert DEFAULT_RADIUS.max_capacity_share == 0.5
    # ... as much of the capacity as the safety rule lets its worker faults take.
    looser = validate_experiment(experiment(blast_radius=None, safety={"per_kind": {"worker": 1.0}}))
    assert looser.radius().max_capacity_share == 1.0
    for path in sorted(LIBRARY.glob("*.yaml")):
        lib = load_experiment(path)
        assert not lib.method or lib.blast_radius is not None, f"{path.name} has faults and no blast_radius"


def test_attached_under_another_node_the_radius_is_renamed_with_the_workers() -> None:
    exp = validate_experiment(experiment(blast_radius={"workers": ["node-w1", "node-w*"], "nodes": ["node"],
                                                       "links": ["router->worker:node-w1"]}))
    renamed = on_node(exp, "edge1")
    assert renamed.radius().workers == ("edge1-w1", "edge1-w*")
    assert renamed.radius().nodes == ("edge1",) and renamed.radius().links == ("router->worker:edge1-w1",)


def test_capacity_out_of_service_counts_unregistered_and_unroutable_workers_only() -> None:
    snap = FleetSnapshot("c")
    for w in ("a", "b", "c"):
        snap.workers[w] = WorkerRecord(id=w, url=f"http://{w}", role="aggregated", model="m", node="n",
                                       backend="sim")
    snap.health["a"] = HealthRecord(state=HealthState.READY)
    snap.health["b"] = HealthRecord(state=HealthState.SUSPECT)
    snap.health["c"] = HealthRecord(state=HealthState.DRAINING)
    down = out_of_service(snap, ["a", "b", "c", "d"])  # d: not registered; no health record counts as serving
    assert down == {"c": "draining", "d": "not registered"}
    assert capacity_breach(down, ["a", "b", "c", "d"], 0.5) is None
    breach = capacity_breach(down, ["a", "b", "c", "d"], 0.34)
    assert breach is not None and "2 of 4 worker(s) out of service (c (draining), d (not registered))" in breach


# -- at run time ----------------------------------------------------------------------------------------------


def test_at_run_time_picks_choose_inside_the_radius_and_named_targets_outside_it_are_refused() -> None:
    import random

    from fleetward.chaos.runner import SafetyAbort

    exp = validate_experiment(experiment(fleet={"workers": 3, "sim": SIM},
                                         blast_radius={"workers": ["node-w1", "node-w2"], "max_capacity_share": 0.34}))
    runner = Runner(exp)
    runner._declared = {"worker": ["node-w0", "node-w1", "node-w2"], "router": ["router-0"], "fleet": ["fleet"]}
    for seed in range(8):  # whatever the seed, a pick never leaves the radius
        picked = runner.resolve(Target(kind="worker", pick="random"), rng=random.Random(seed))
        assert picked[0] in {"node-w1", "node-w2"}
    assert runner.resolve(Target(kind="worker", pick="all"), rng=random.Random(0)) == ["node-w1", "node-w2"]
    with pytest.raises(SafetyAbort, match=r"worker node-w0 outside the blast radius \(workers node-w1, node-w2"):
        runner.resolve(Target(kind="worker", ids=("node-w0",)), rng=random.Random(0))
    with pytest.raises(SafetyAbort, match="no router of the fleet is inside the blast radius"):
        runner.resolve(Target(kind="router", pick="first"), rng=random.Random(0))
    # The capacity share bounds the worker faults in effect at once, as the safety share does.
    runner.active["first"] = ("worker", ["node-w1"])
    with pytest.raises(SafetyAbort, match=r"would fault 2 of 3 worker\(s\) at once .* over the limit 0.34"):
        runner._check_share(runner.catalogue["process.hang"], Target(kind="worker"), ["node-w2"], "second")


async def test_the_run_aborts_and_rolls_back_when_the_fleet_breaks_beyond_the_radius(
        fleetward_experiment: Any) -> None:
    # The fault's target, node-w0, is inside the radius and half the capacity: allowed. Its collateral damage
    # (node-w1 drained too) takes all of it: the runner must abort, recover the fault and run the rollbacks.
    exp = experiment(
        title="collateral beyond the radius",
        method=[{"name": "drain", "fault": "process.test_collateral_drain", "at": 0.3, "duration": 120,
                 "target": {"kind": "worker", "ids": ["node-w0"]}, "params": {"collateral": ["node-w1"]}}],
        blast_radius={"workers": ["node-w0"], "max_capacity_share": 0.5})
    result = await fleetward_experiment(exp)
    j = result.journal
    assert result.status == "aborted" and result.exit_code == 1, j["reason"]
    assert "beyond the blast radius: 2 of 2 worker(s) out of service" in j["reason"]
    assert j["blast_radius"]["declared"] and j["blast_radius"]["workers"] == ["node-w0"]
    (drain,) = j["run"]
    assert drain["output"]["recovered"] is True
    records = [json.loads(line) for line in (result.run_dir / "history.jsonl").read_text().splitlines()]
    order = [("breach" if r["type"] == "note" and r.get("blast_radius") else r["phase"]) for r in records
             if (r["type"] == "fault" and r["activity"] == "drain") or (r["type"] == "note" and r.get("blast_radius"))]
    # Held until the breach (which may come while the fault still verifies itself), then recovered.
    assert [p for p in order if p != "verified"] == ["start", "breach", "recover", "recovered", "stop"]
    assert [rb["status"] for rb in j["rollbacks"]] == ["succeeded"]
    assert j["steady_states"]["after"]["steady_state_met"]  # every worker routable again


# -- --dry-run --------------------------------------------------------------------------------------------------


async def test_a_dry_run_prints_the_plan_and_touches_nothing_even_on_a_live_fleet(
        fleetward_fleet: Any, tmp_path: Path) -> None:
    async with fleetward_fleet(workers=2, backend=SimBackend(SimConfig(**SIM))) as fleet:
        run_dir = await attachable(fleet, tmp_path / "state")
        exp = experiment(method=[
            {"name": "hang", "fault": "process.hang", "at": 0.5, "duration": 1.0,
             "target": {"kind": "worker", "ids": ["node-w1"]}},
            {"name": "again", "fault": "process.hang", "after": "hang", "delay": 0.5, "duration": 0.5,
             "target": {"kind": "worker", "pick": "serving"}}])
        path = tmp_path / "exp.yaml"
        path.write_text(yaml.safe_dump(exp))
        async with fault_events(fleet) as seen:
            done = await asyncio.to_thread(chaos, "run", str(path), "--attach", "--live-fleet", "--cluster",
                                           fleet.cluster, "--run-dir", str(run_dir), "--out", str(tmp_path / "run"),
                                           "--dry-run", env=env_without_token())
        assert done.returncode == 0, done.stdout + done.stderr
        out = " ".join(done.stdout.split())
        assert f"would attach to the local fleet {fleet.cluster}" in out
        assert "blast radius: declared: workers node-w1; max capacity share 0.5" in out
        assert "t=0.5..1.5 s hang: process.hang on worker node-w1 (at 0.5 s)" in out
        assert ("t=2..2.5 s again: process.hang on worker: 1 by pick serving of node-w1 (0.5 s after hang has "
                "recovered)") in out
        assert "nothing was started or injected" in out
        assert seen == [] and await nothing_hung(fleet)
        assert not (tmp_path / "run").exists()


def test_a_dry_run_exits_2_with_the_error_when_the_radius_or_the_flag_refuses(tmp_path: Path) -> None:
    path = tmp_path / "outside.yaml"
    path.write_text(yaml.safe_dump(experiment(blast_radius={"workers": ["node-w0"]})))
    done = chaos("run", str(path), "--dry-run")
    assert done.returncode == 2
    assert f"{path}:" in done.stderr and "method[0].target.ids: process.hang would hit node-w1" in " ".join(
        done.stderr.split())
    assert "dry run" not in done.stdout

    state = tmp_path / "state" / "local"
    state.mkdir(parents=True)
    (state / "fleet.json").write_text(json.dumps({"cluster": "local", "etcd": "127.0.0.1:9", "mqtt": "127.0.0.1:9"}))
    inside = tmp_path / "inside.yaml"
    inside.write_text(yaml.safe_dump(experiment()))
    for flags in (["--dry-run"], []):  # a dry run meets the refusals a run would, before it begins
        done = chaos("run", str(inside), "--attach", "--run-dir", str(tmp_path / "state"), "--out",
                     str(tmp_path / "run"), *flags, env=env_without_token())
        assert done.returncode == 2, done.stdout + done.stderr
        assert "--live-fleet: the fleet of cluster local" in " ".join(done.stderr.split())
        assert not (tmp_path / "run").exists()


# -- a fleet the run did not start ------------------------------------------------------------------------------


async def test_injecting_into_a_fleet_the_run_did_not_start_needs_the_flag_a_radius_and_its_admin_token(
        fleetward_fleet: Any, fleetward_experiment: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEETWARD_ADMIN_TOKEN", raising=False)
    async with fleetward_fleet(workers=2, backend=SimBackend(SimConfig(**SIM))) as fleet:
        run_dir = await attachable(fleet, tmp_path / "state")

        def attach(live: bool, **over: Any) -> Runner:
            return Runner(validate_experiment(experiment(**over)), RunOptions(
                out=tmp_path / "run", attach=True, live_fleet=live, cluster=fleet.cluster, run_dir=run_dir))

        async with fault_events(fleet) as seen:
            with pytest.raises(ConfigError) as info:
                await attach(False).run()
            assert info.value.field == "--live-fleet"
            assert f"the fleet of cluster {fleet.cluster}" in info.value.problem
            assert "injecting 1 fault(s) (hang) into it needs --live-fleet" in info.value.problem

            with pytest.raises(ConfigError) as info:
                await attach(True, blast_radius=None).run()
            assert info.value.field == "blast_radius"

            token = run_dir / fleet.cluster / "admin-token"
            token.unlink()
            with pytest.raises(ConfigError) as info:
                await attach(True).run()
            assert info.value.field == "FLEETWARD_ADMIN_TOKEN" and "no admin token" in info.value.problem

            monkeypatch.setenv("FLEETWARD_ADMIN_TOKEN", "not-the-fleets")
            with pytest.raises(ConfigError, match="worker node-w0 refuses the admin token"):
                await attach(True).run()
            monkeypatch.delenv("FLEETWARD_ADMIN_TOKEN")

            # A fleet reached through its etcd, not attached to: the run's own fleet may not join it.
            with pytest.raises(ConfigError) as info:
                await fleetward_experiment(experiment(fleet={"workers": 2, "sim": SIM, "cluster": fleet.cluster}))
            assert info.value.field == "fleet.cluster" and "this run did not start" in info.value.problem
        assert seen == [] and await nothing_hung(fleet)
        assert not (tmp_path / "run").exists()
