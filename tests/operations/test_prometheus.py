"""``fleetward up --prometheus`` as a user runs it: a real Prometheus (Debian's) scrapes every service and worker
found in etcd, loads the alert rules, and a silent hang on a worker makes ``FleetwardWorkerHung`` fire, read
back through Prometheus' HTTP API and on the controller's fleet page (in headless Chromium, with its runbook
link); then every query of every dashboard panel returns data."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import httpx
import orjson
from testkit import signal_named

from fleetward.cli.dashboards import panel_queries
from fleetward.fleet.sse import sse_lines


async def test_up_prometheus_scrapes_the_fleet_and_an_alert_fires_on_a_silent_hang(
        tmp_path: Path, wait_until: Any, prometheus_installed: None, fleetward_up: Any, browser: Any) -> None:
    conf = tmp_path / "fleet.yaml"
    conf.write_text("workers: 2\nprometheus:\n  scrape_interval_s: 1\nsupervisor:\n  canary_interval_s: 2\n"
                    "sim:\n  decode_step_ms: 20\nautoscale:\n  interval_s: 1\n  min_workers: 2\n  max_workers: 2\n"
                    "  per_worker_rps: 4\n")
    async with fleetward_up("--prometheus", "--autoscale", "--config", str(conf), run_dir=tmp_path,
                            cluster="promtest") as up:
        def ready() -> dict[str, Any] | None:
            data = up.status()
            if not data or not data["prometheus"]:
                return None
            return data if sorted(w["health"] for w in data["workers"]) == ["ready", "ready"] else None

        data = await wait_until(ready, timeout=90, interval=0.5, message="2 ready workers and Prometheus")
        prom = data["prometheus"]
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            async def targets_up() -> set[str] | None:
                body = (await client.get(prom + "/api/v1/targets")).json()["data"]["activeTargets"]
                jobs = {t["labels"]["job"] for t in body if t["health"] == "up"}
                return jobs if jobs >= {"router", "controller", "worker", "autoscaler", "agent"} else None

            await wait_until(targets_up, timeout=60, interval=0.5, message="every service scraped and up")
            rules = (await client.get(prom + "/api/v1/rules")).json()["data"]["groups"]
            assert {"fleetward-workers", "fleetward-slo", "fleetward-control-plane"} <= {g["name"] for g in rules}
            firing = (await client.get(prom + "/api/v1/alerts")).json()["data"]["alerts"]
            assert [a for a in firing if a["labels"]["alertname"] == "FleetwardWorkerHung"] == [], "quiet so far"
            # A stream, then SIGSTOP the worker under it: alive, /health never asked, no tokens.
            stopped: list[int] = []
            async with client.stream("POST", data["routers"][0]["url"] + "/v1/completions",
                                     json={"model": "sim-tiny", "prompt": "hang here", "max_tokens": 400,
                                           "stream": True}, headers={"X-Fleetward-Trace": "1"}) as r:
                async for line in sse_lines(r.aiter_bytes()):
                    if not stopped and line.startswith("data: {"):
                        worker = orjson.loads(line[6:])["fleetward"]["worker"]
                        named = next(w for w in data["workers"] if w["id"] == worker)
                        signal_named(named, signal.SIGSTOP)
                        stopped.append(named["pid"])

            async def hung_alert() -> bool:
                alerts = (await client.get(prom + "/api/v1/alerts")).json()["data"]["alerts"]
                return any(a["labels"]["alertname"] == "FleetwardWorkerHung" and a["state"] == "firing"
                           and a["annotations"]["runbook_url"] == "runbooks/worker-hung.md" for a in alerts)

            await wait_until(hung_alert, timeout=90, interval=0.5, message="FleetwardWorkerHung fires")

            # The fleet page lists it, firing, with a link to its runbook that the controller serves.
            async def on_the_page() -> str | None:
                dom = await browser.dom(data["dashboard"])
                row = re.search(r'<tr data-alert="FleetwardWorkerHung" data-state="firing">(.*?)</tr>', dom, re.S)
                return row.group(1) if row else None

            row = await wait_until(on_the_page, timeout=30, interval=0.5, message="the alert on the fleet page")
            link = re.search(r'href="([^"]+)">runbook<', row)
            assert link is not None and link.group(1) == "/runbooks/worker-hung.md", row
            runbook = await client.get(data["controller"]["url"] + link.group(1))
            assert runbook.status_code == 200 and "<h2>Remedy</h2>" in runbook.text

            # Every dashboard panel, as Grafana would ask for it now: some value that is a number.
            async def empty_panels() -> list[str]:
                missing = []
                for uid, title, expr in panel_queries():
                    result = (await client.get(prom + "/api/v1/query", params={"query": expr})).json()["data"]
                    values = [float(r["value"][1]) for r in result["result"]]
                    if not [v for v in values if v == v]:  # none, or only NaN (a quantile of nothing)
                        missing.append(f"{uid} / {title}: {expr}")
                return missing

            async def all_have_data() -> bool:
                return not await empty_panels()

            try:
                await wait_until(all_have_data, timeout=30, interval=1.0, message="every panel has data")
            except BaseException:
                raise AssertionError("panels without data:\n" + "\n".join(await empty_panels())) from None
