"""The incident loop against a real Prometheus (Debian's): on a live fleet under load, a fault-free stretch
raises no alert at all; then chaos faults from the catalogue (a worker SIGKILLed, a worker silently hung,
the broker killed and started again) make the alerts they should raise go pending, fire, and resolve after
recovery, all read back through Prometheus' HTTP API (``/api/v1/alerts`` and the ``ALERTS`` series).

Prometheus runs the shipped rule file with every duration divided by ``SCALE`` (a 10-minute window becomes
15 s, ``for: 1m`` 2 s), so that an alert also resolves within the test: the pipeline is the real one
(exposition, discovery from etcd, scraping, rule evaluation, alert states), the timing is compressed.
promtool's unit tests (tests/operations/test_alerts.py) check the same expressions at their real durations.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

import fleetward.chaos.faults  # noqa: F401 - fills the catalogue (run alone, nothing else imports it)
from fleetward.chaos.fault import CATALOGUE, Target
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import RouterConfig, SimConfig, SupervisorConfig
from fleetward.fleet.keys import Keys
from fleetward.fleet.prometheus import LocalPrometheus, TargetsWriter
from fleetward.fleet.sse import sse_lines

RULES = Path(__file__).resolve().parents[2] / "runbooks" / "alerts" / "fleetward.rules.yml"
SCALE = 40
SIM = SimConfig(decode_step_ms=8.0, decode_ms_per_seq=0.1, prefill_ms_per_token=0.02, seed=31)
SUPERVISOR = SupervisorConfig(canary_interval_s=2.0, canary_timeout_s=2.0, backoff_initial_s=0.05,
                              backoff_max_s=0.2, lease_ttl_s=3, progress_interval_s=0.1)
_UNIT = {"s": 1, "m": 60, "h": 3600}


def scaled_rules(dst: Path) -> Path:
    """The shipped rules with every range and ``for`` divided by SCALE (whole seconds, at least 1)."""

    def scale(m: re.Match[str]) -> str:
        return f"{max(1, round(int(m.group(2)) * _UNIT[m.group(3)] / SCALE))}s"

    text = re.sub(r"(\[)(\d+)([smh])(?=\])", lambda m: "[" + scale(m), RULES.read_text())
    text = re.sub(r"(?m)^(\s*for: )(\d+)([smh])\s*$", lambda m: m.group(1) + scale(m), text)
    dst.write_text(text)
    return dst


def test_the_scaled_rules_keep_every_alert_and_only_shorten_time(tmp_path: Path) -> None:
    original, scaled = RULES.read_text(), scaled_rules(tmp_path / "rules.yml").read_text()
    assert re.findall(r"alert: (\w+)", original) == re.findall(r"alert: (\w+)", scaled)
    assert "[10m]" in original and "[15s]" in scaled and "[10m]" not in scaled
    assert "for: 1m" in original and "for: 2s" in scaled and "for: 1m" not in scaled
    strip = re.compile(r"\[\d+[smh]\]|for: \d+[smh]")
    assert strip.sub("", original) == strip.sub("", scaled), "nothing but durations changed"


@pytest.fixture
def prom(tmp_path: Path, prometheus_installed: None) -> LocalPrometheus:
    """The Prometheus, its port chosen (the controller's fleet page is told where its alerts are), not started."""
    return LocalPrometheus(tmp_path / "prometheus", scrape_interval_s=1.0,
                           rule_files=(scaled_rules(tmp_path / "rules.yml"),))


@pytest_asyncio.fixture
async def fleet(etcd_endpoint: str, tmp_path: Path, prom: LocalPrometheus) -> AsyncIterator[TestFleet]:
    supervisor = SUPERVISOR.model_copy(update={"prometheus_url": prom.url})
    async with TestFleet(etcd=etcd_endpoint, mqtt="", own_broker=True, cluster="alerts", workers=3,
                         run_dir=tmp_path / "fleet", backend=SimBackend(SIM), supervisor=supervisor,
                         controller_processes=1, routing=RouterConfig(stall_floor_s=0.5)) as f:
        await f.start_router("r0")
        yield f


@pytest_asyncio.fixture
async def prometheus(fleet: TestFleet, tmp_path: Path, prom: LocalPrometheus) -> AsyncIterator[str]:
    writer = TargetsWriter(prom, fleet.store, Keys(fleet.cluster), every_s=1.0)
    await writer.refresh()
    prom.start(tmp_path)
    refresher = asyncio.create_task(writer.run())
    try:
        await prom.wait_ready()
        yield prom.url
    finally:
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher
        await prom.stop()


async def load(router: str, stop: asyncio.Event) -> None:
    """Three clients streaming one request after another until ``stop``."""

    async def client(i: int) -> None:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as c:
            n = 0
            while not stop.is_set():
                n += 1
                body = {"model": SIM.model_name, "prompt": f"client {i} request {n}: ", "max_tokens": 48,
                        "stream": True}
                with contextlib.suppress(httpx.HTTPError):
                    async with c.stream("POST", router + "/v1/completions", json=body) as r:
                        async for _ in sse_lines(r.aiter_bytes()):
                            pass

    await asyncio.gather(*(client(i) for i in range(3)))


class Alerts:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.AsyncClient(timeout=10, trust_env=False)

    async def now(self) -> dict[str, str]:
        """Alert name → its state (pending or firing) now."""
        body = (await self.http.get(self.url + "/api/v1/alerts")).json()["data"]["alerts"]
        return {a["labels"]["alertname"]: a["state"] for a in body}

    async def ever(self, name: str, state: str, within_s: int = 300) -> bool:
        """Whether ``ALERTS`` recorded ``name`` in ``state`` at any evaluation of the last ``within_s`` s."""
        query = f'max_over_time(ALERTS{{alertname="{name}", alertstate="{state}"}}[{within_s}s])'
        result = (await self.http.get(self.url + "/api/v1/query", params={"query": query})).json()["data"]
        return bool(result["result"])

    async def any_since(self, within_s: int) -> list[str]:
        query = f"count by (alertname, alertstate) (count_over_time(ALERTS[{within_s}s]))"
        result = (await self.http.get(self.url + "/api/v1/query", params={"query": query})).json()["data"]
        return sorted(f"{r['metric']['alertname']} ({r['metric']['alertstate']})" for r in result["result"])

    async def targets_up(self) -> set[str]:
        body = (await self.http.get(self.url + "/api/v1/targets")).json()["data"]["activeTargets"]
        return {f"{t['labels']['job']}/{t['labels']['instance']}" for t in body if t["health"] == "up"}


async def page_shows_the_incident(fleet: TestFleet, browser: Any, wait_until: Any) -> None:
    """The controller's fleet page during the incident: both alerts firing with their runbooks, both faults in
    effect, the hang on the timeline. ``FLEETWARD_PAGE_SCREENSHOT=path`` keeps a screenshot (docs/img's)."""
    page = fleet.controller_procs[0].url + "/"

    async def complete() -> str | None:
        dom = await browser.dom(page)
        firing = set(re.findall(r'<tr data-alert="(\w+)" data-state="firing">', dom))
        ok = ({"FleetwardWorkerFailed", "FleetwardWorkerHung"} <= firing and "2 process" in dom
              and 'data-kind="hang.detected"' in dom and 'href="/runbooks/worker-hung.md"' in dom)
        return dom if ok else None

    await wait_until(complete, timeout=30, interval=0.5, message="the incident on the fleet page")
    shot = os.environ.get("FLEETWARD_PAGE_SCREENSHOT")
    if shot:
        await browser.screenshot(page, Path(shot), height=1250)


async def test_alerts_stay_quiet_without_faults_then_fire_and_resolve_on_a_kill_a_hang_and_a_broker_restart(
        fleet: TestFleet, prometheus: str, wait_until: Any, browser: Any) -> None:
    alerts = Alerts(prometheus)
    workers = sorted(fleet.worker_ids)
    for w in workers:
        await fleet.ensure_serving(w)
    expected = {"router/r0", f"agent/{fleet.node}", *(f"worker/{w}" for w in workers)}

    async def all_up() -> bool:
        up = await alerts.targets_up()
        return expected <= up and any(t.startswith("controller/") for t in up)

    await wait_until(all_up, timeout=60, interval=0.5, message="Prometheus scrapes router, controller, agent, workers")
    stop = asyncio.Event()
    clients = asyncio.create_task(load(fleet.routers[0].url, stop))
    ctx = fleet.fault_context()
    try:
        # -- a fault-free stretch under load: no alert, not even pending, at any evaluation ----------------
        # Until Prometheus has scraped everything once, "no leader" may rightly be pending (even fire, at the
        # scaled 2 s): the stretch starts once no alert is active, and lasts longer than the scaled 10-minute
        # window of the worker alerts.
        async def none_active() -> bool:
            return not await alerts.now()

        await wait_until(none_active, timeout=30, interval=0.5,
                         message="the start-up alerts resolve once every target is scraped")
        loop = asyncio.get_running_loop()
        quiet_s, started = 600 // SCALE + 5, loop.time()
        seen: set[str] = set()
        while loop.time() - started < quiet_s:
            seen |= {f"{n} ({s})" for n, s in (await alerts.now()).items()}
            await asyncio.sleep(0.5)  # polling cadence of the observation window, not synchronisation
        assert seen == set(), f"alerts without any fault: {sorted(seen)}"
        # Every evaluation of the stretch (but the first second, which may hold the last start-up one).
        assert await alerts.any_since(quiet_s - 1) == [], "ALERTS recorded an alert without any fault"

        # -- a worker killed and another silently hung, at once -------------------------------------------
        faults = []
        for name, worker, params in (("process.kill_worker", workers[0], {"scope": "tree"}),
                                     ("process.hang", workers[1], {"mode": "silent"})):
            spec = CATALOGUE[name]
            fault = spec.factory(spec.params(**params), Target(kind="worker", ids=(worker,)))
            # What `fleetward chaos run` publishes around a fault (the page's timeline, the faults gauge).
            await fleet.bus.publish("fault.start", activity=name, fault=name, family=spec.family, targets=[worker],
                                    worker=worker)
            await fault.inject(ctx)
            assert await fault.verify(ctx), fault.describe()
            faults.append((fault, name, spec.family, worker))

        async def firing(*names: str) -> bool:
            now = await alerts.now()
            return all(now.get(n) == "firing" for n in names)

        await wait_until(lambda: firing("FleetwardWorkerFailed", "FleetwardWorkerHung"), timeout=60, interval=0.3,
                         message="FleetwardWorkerFailed and FleetwardWorkerHung fire")
        await page_shows_the_incident(fleet, browser, wait_until)

        # The alert fires on the exit seen beginning (/proc); the exit is counted when it completes, which on a
        # busy host can be seconds later, and Prometheus has it at its next scrape.
        async def exit_counted() -> bool:
            exits = (await alerts.http.get(prometheus + "/api/v1/query",
                                           params={"query": "sum(fleetward_agent_worker_exits_total)"})).json()
            result = exits["data"]["result"]
            return bool(result) and float(result[0]["value"][1]) >= 1

        await wait_until(exit_counted, timeout=30, interval=0.5,
                         message="the node agent counted the killed worker's exit")
        for fault, name, family, worker in faults:
            await fault.recover(ctx)
            assert await fault.verify_recovered(ctx), fault.describe()
            await fleet.bus.publish("fault.stop", activity=name, fault=name, family=family, targets=[worker],
                                    worker=worker)
        for w in workers[:2]:
            await fleet.ensure_serving(w)

        async def resolved(*names: str) -> bool:
            now = await alerts.now()
            return not any(n in now for n in names)

        await wait_until(lambda: resolved("FleetwardWorkerFailed", "FleetwardWorkerHung"), timeout=90,
                         interval=0.5, message="both resolve once their window holds no failure")
        for name in ("FleetwardWorkerFailed", "FleetwardWorkerHung"):
            assert await alerts.ever(name, "pending"), f"{name} fired without going pending first"

        # -- the broker killed, then started again --------------------------------------------------------
        spec = CATALOGUE["control.broker_restart"]
        broker = spec.factory(spec.params(), Target(kind="broker", ids=("broker",)))
        try:
            await broker.inject(ctx)
            assert await broker.verify(ctx), broker.describe()
            await wait_until(lambda: firing("FleetwardBrokerUnreachable"), timeout=60, interval=0.3,
                             message="FleetwardBrokerUnreachable fires while the broker is down")
        finally:
            await broker.recover(ctx)
        assert await broker.verify_recovered(ctx), broker.describe()
        await wait_until(lambda: resolved("FleetwardBrokerUnreachable"), timeout=60, interval=0.5,
                         message="FleetwardBrokerUnreachable resolves once every service is connected again")
        assert await alerts.ever("FleetwardBrokerUnreachable", "pending")
    finally:
        stop.set()
        await clients
        await alerts.http.aclose()
