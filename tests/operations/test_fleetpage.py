"""The controller's live fleet page: what its feed says of each event and alert, the runbooks it serves, and
the page itself in a real browser (headless Chromium) against ``fleetward up``: a killed worker shows up
within the detection time, and the worker comes back on the page."""

from __future__ import annotations

import html
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import yaml
from testkit import signal_named

from fleetward.fleet.bus import EVENT_KINDS, Event
from fleetward.supervisor.fleetpage import Timeline, describe, parse_alerts, runbook_html

RULES = Path(__file__).resolve().parents[2] / "runbooks" / "alerts" / "fleetward.rules.yml"
_ROW = re.compile(r'<tr data-worker="([^"]+)" data-state="([^"]+)">')
_EVENT = re.compile(r'<li data-kind="([^"]+)" data-worker="([^"]*)">(.*?)</li>', re.S)
_ALERT = re.compile(r'<tr data-alert="([^"]+)" data-state="([^"]+)">(.*?)</tr>', re.S)


def worker_rows(dom: str) -> dict[str, str]:
    return dict(_ROW.findall(dom))


def events(dom: str) -> list[tuple[str, str, str]]:
    return [(kind, worker, html.unescape(re.sub(r"<[^>]+>", "", text))) for kind, worker, text in _EVENT.findall(dom)]


def event(kind: str, ts: float = 1.0, **data: Any) -> Event:
    return Event(kind=kind, cluster="c", ts=ts, data=data)


# -- the feed, without IO -----------------------------------------------------------------------------------


def test_the_timeline_keeps_the_newest_events_and_counts_the_faults_in_effect() -> None:
    t = Timeline(size=3)
    start = {"activity": "kill", "fault": "process.kill_worker", "family": "process", "targets": ["w1"]}
    t.add(event("fault.start", 1, **start))
    t.add(event("fault.start", 2, activity="cut", fault="network.partition", family="network", targets=["w2"]))
    assert t.faults_by_family() == {"process": 1, "network": 1}
    t.add(event("fault.stop", 3, **start))
    assert t.faults_by_family() == {"network": 1}
    t.add(event("migration", 4, request="r1", worker="w3", from_worker="w2", tokens=7, reason="worker unhealthy"))
    assert [e["ts"] for e in t.recent()] == [2, 3, 4], "the oldest went first"
    assert t.recent()[-1]["worker"] == "w2", "a migration sits on the row of the worker the stream left"


def test_every_event_kind_reads_as_a_sentence_not_a_dump() -> None:
    samples: dict[str, dict[str, Any]] = {
               "worker.up": {"url": "http://w"}, "worker.down": {"reason": "killed", "exit_code": -9},
               "health.changed": {"previous": "ready", "state": "unhealthy", "detector": "process", "reason": "x"},
               "hang.detected": {"detector": "stream-progress", "reason": "no token"},
               "migration": {"request": "r", "from_worker": "a", "worker": "b", "tokens": 3, "reason": "y"},
               "restart": {"attempt": 1, "delay_s": 0.5, "reason": "z"}, "quarantine": {"gpus": [0], "reason": "xid"},
               "action": {"action_kind": "restart", "status": "done", "reason": ""},
               "scale": {"pool": "aggregated", "desired": 3, "serving": 2, "starting": 1, "reason": "load"},
               "move": {"request": "r", "from_worker": "a", "worker": "b", "trigger": "drain", "outcome": "kv",
                        "kv_tokens": 8192, "kv_bytes": 2097152, "stall_s": 0.012},
               "fault.start": {"fault": "process.hang", "targets": ["w"], "activity": "h"},
               "fault.stop": {"fault": "process.hang", "targets": ["w"], "activity": "h"},
               "poison": {"request": "r", "body_sha256": "0123456789abcdef", "worker": "b", "workers": ["a", "b"],
                          "reasons": ["reset: x", "eof: y"]}}
    assert set(samples) == set(EVENT_KINDS)
    for kind, data in samples.items():
        text = describe(event(kind, **data))
        assert text and "=" not in text, (kind, text)
    assert describe(event("health.changed", **samples["health.changed"])) == "ready → unhealthy (process: x)"
    assert "gpus=" in describe(event("quarantine", gpus=5)), "a malformed event is shown as it came, not a crash"


def test_prometheus_alerts_are_listed_firing_first_with_their_runbooks() -> None:
    def alert(name: str, state: str) -> dict[str, Any]:
        return {"labels": {"alertname": name, "severity": "warning"}, "state": state, "activeAt": "t",
                "annotations": {"summary": "s", "runbook_url": f"runbooks/{name}.md"}}

    body = {"status": "success", "data": {"alerts": [alert("B", "pending"), alert("C", "firing"),
                                                     alert("A", "pending")]}}
    listed = parse_alerts(body)
    assert [(a["name"], a["state"]) for a in listed] == [("C", "firing"), ("A", "pending"), ("B", "pending")]
    assert listed[0]["runbook_url"] == "runbooks/C.md"
    assert parse_alerts({"status": "success", "data": {}}) == []


def test_the_runbook_of_every_alert_is_served_as_a_page_and_nothing_else_is() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    for rule in rules:
        name = Path(rule["annotations"]["runbook_url"]).stem
        page = runbook_html(name)
        assert page is not None and rule["alert"] in page and "<h2>Remedy</h2>" in page, name
    for bad in ("../pyproject", "missing", "worker-hung.md", "", "a/b"):
        assert runbook_html(bad) is None, bad


# -- the page in a browser --------------------------------------------------------------------------------


async def test_the_fleet_page_in_a_browser_shows_a_killed_worker_within_the_detection_time(
        tmp_path: Path, wait_until: Any, browser: Any, fleetward_up: Any) -> None:
    conf = tmp_path / "fleet.yaml"
    conf.write_text("workers: 2\nsupervisor:\n  canary_interval_s: 2\n")
    async with fleetward_up("--config", str(conf), run_dir=tmp_path, cluster="pagetest") as up:
        def ready() -> dict[str, Any] | None:
            data = up.status()
            ok = data and sorted(w["health"] for w in data["workers"]) == ["ready", "ready"] and data["dashboard"]
            return data if ok else None

        data = await wait_until(ready, timeout=90, interval=0.5, message="2 ready workers")
        page = data["dashboard"]
        assert page == data["controller"]["url"] + "/", "status --json names the fleet page: the controller's"
        ids = sorted(w["id"] for w in data["workers"])

        dom = await browser.dom(page)
        assert worker_rows(dom) == dict.fromkeys(ids, "ready")
        assert "no Prometheus configured" in dom, "without Prometheus the alerts panel says so"
        assert {w for kind, w, _ in events(dom) if kind == "worker.up"} == set(ids)

        victim = data["workers"][0]
        signal_named(victim, signal.SIGKILL)

        async def shown() -> list[tuple[str, str, str]]:
            seen = events(await browser.dom(page))
            return [e for e in seen if e[1] == victim["id"] and e[0] == "health.changed" and "→ unhealthy (process:"
                    in e[2]]

        found = await wait_until(shown, timeout=30, interval=0.3, message="the kill on the page")
        assert "exited" in found[0][2], found

        async def back() -> bool:
            rows = worker_rows(await browser.dom(page))
            return rows.get(victim["id"]) == "ready"

        await wait_until(back, timeout=60, interval=0.5, message="the restarted worker ready again on the page")
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            feed = (await client.get(page + "v1/fleet")).json()
        restarted = next(w for w in feed["workers"] if w["id"] == victim["id"])
        assert restarted["restarts"] == 1 and restarted["state"] == "ready"
        shot = await browser.screenshot(page, tmp_path / "page.png")
        assert shot.stat().st_size > 10_000
