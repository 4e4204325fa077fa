"""The controller's live fleet page: what it shows, gathered where the controller already looks.

``GET /`` serves one static page (``fleetpage.html``: HTML and a little JavaScript, no build step, nothing
downloaded) that polls ``GET /v1/fleet`` every second. The feed joins:

- the health machine's view of every worker (state, detector, reason, restarts) and the routers' stream
  progress (in-flight streams per worker), as the leader holds them;
- a :class:`Timeline`: the last events of the cluster's bus (health changes, hangs, restarts, quarantines,
  migrations, agent actions, scaling, chaos faults), which every controller, leader or not, subscribes to;
- the alerts of a Prometheus (``supervisor.prometheus_url``), each with its runbook link, which resolves
  against ``/runbooks/<name>.md``: the controller serves the shipped runbooks as HTML.

It works without Grafana and without Prometheus (then the alerts panel says so).
"""

from __future__ import annotations

import collections
import html
import importlib.resources
import re
from typing import Any

from markdown_it import MarkdownIt

from fleetward.fleet.bus import Event

__all__ = ["Timeline", "describe", "page_html", "parse_alerts", "runbook_html"]

_RUNBOOK = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def describe(event: Event) -> str:
    """One line an operator reads on the timeline (whatever the event carries: it came over the wire)."""
    try:
        return _describe(event.kind, event.data)
    except (TypeError, ValueError, AttributeError):
        return _dump(event.data)


def _dump(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(d.items()))[:200]


def _describe(kind: str, d: dict[str, Any]) -> str:
    match kind:
        case "worker.up":
            return f"up at {d.get('url', '?')}"
        case "worker.down":
            code = f", exit code {d['exit_code']}" if d.get("exit_code") is not None else ""
            return f"down: {d.get('reason') or 'no reason given'}{code}"
        case "health.changed":
            why = f" ({d.get('detector') or '-'}: {d.get('reason')})" if d.get("reason") else ""
            return f"{d.get('previous') or '-'} → {d.get('state')}{why}"
        case "hang.detected":
            return f"silent hang ({d.get('detector') or '-'}: {d.get('reason') or ''})"
        case "restart":
            return f"restart #{d.get('attempt', '?')} in {float(d.get('delay_s') or 0):g} s: {d.get('reason') or ''}"
        case "quarantine":
            gpus = ", ".join(str(g) for g in d.get("gpus") or []) or "no GPU"
            return f"quarantined ({gpus}): {d.get('reason') or ''}"
        case "migration":
            return (f"stream {str(d.get('request', '?'))[:16]} moved {d.get('from_worker') or '?'} → "
                    f"{d.get('worker') or '?'} after {d.get('tokens', '?')} tokens ({d.get('reason') or ''})")
        case "move":
            kv = int(d.get("kv_bytes") or 0)
            carried = (f"with its KV ({d.get('kv_tokens', 0)} tokens" + (f", {kv / 1e6:.1f} MB)" if kv else ")")
                       if d.get("outcome") == "kv" else "computed again" if d.get("outcome") == "reprefill"
                       else "failed")
            stall = f", stall {float(d['stall_s']) * 1000:.0f} ms" if d.get("stall_s") is not None else ""
            return (f"planned move ({d.get('trigger', '?')}) of stream {str(d.get('request', '?'))[:16]} "
                    f"{d.get('from_worker') or '?'} → {d.get('worker') or '?'}: {carried}{stall}")
        case "poison":
            workers = ", ".join(str(w) for w in d.get("workers") or []) or "?"
            return (f"request {str(d.get('request', '?'))[:16]} (body sha256 {d.get('body_sha256', '?')}) not sent "
                    f"to another worker: {workers} failed while serving it")
        case "action":
            return f"agent {d.get('action_kind', '?')} {d.get('status', '')}: {d.get('reason') or ''}"
        case "scale":
            return (f"pool {d.get('pool')}: want {d.get('desired')} ({d.get('serving')} serving, "
                    f"{d.get('starting')} starting): {d.get('reason') or ''}")
        case "fault.start" | "fault.stop":
            verb = "injected" if kind == "fault.start" else "removed"
            targets = ", ".join(str(t) for t in d.get("targets") or []) or "-"
            return f"fault {d.get('fault')} {verb} on {targets} ({d.get('activity')})"
    return _dump(d)


class Timeline:
    """The cluster's recent events (a bounded ring, oldest dropped first) and the chaos faults in effect."""

    def __init__(self, size: int = 500) -> None:
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)
        self.faults: dict[tuple[str, str, tuple[str, ...]], str] = {}  # (activity, fault, targets) -> family

    def add(self, event: Event) -> None:
        d = event.data
        # A migration or a move belongs on the row of the worker the stream left; the rest on their worker's.
        worker = d.get("from_worker") if event.kind in ("migration", "move") else event.worker
        self.events.append({"ts": event.ts, "kind": event.kind, "worker": worker, "text": describe(event)})
        if event.kind in ("fault.start", "fault.stop"):
            key = (str(d.get("activity")), str(d.get("fault")), tuple(str(t) for t in d.get("targets") or ()))
            if event.kind == "fault.start":
                self.faults[key] = str(d.get("family") or "unknown")
            else:
                self.faults.pop(key, None)

    def faults_by_family(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for family in self.faults.values():
            out[family] = out.get(family, 0) + 1
        return out

    def recent(self, n: int = 200) -> list[dict[str, Any]]:
        return list(self.events)[-n:]


def parse_alerts(body: Any) -> list[dict[str, Any]]:
    """Prometheus' ``/api/v1/alerts`` answer → what the page lists (firing first, then pending)."""
    out = []
    for a in (body.get("data") or {}).get("alerts") or []:
        labels, notes = a.get("labels") or {}, a.get("annotations") or {}
        out.append({"name": labels.get("alertname", "?"), "state": a.get("state", "?"),
                    "severity": labels.get("severity", ""), "summary": notes.get("summary", ""),
                    "description": notes.get("description", ""), "runbook_url": notes.get("runbook_url", ""),
                    "active_at": a.get("activeAt", "")})
    return sorted(out, key=lambda a: (a["state"] != "firing", a["name"]))


def page_html() -> str:
    return (importlib.resources.files("fleetward.supervisor") / "fleetpage.html").read_text(encoding="utf-8")


def runbook_html(name: str) -> str | None:
    """The shipped runbook ``<name>.md`` as a page, or None when there is no such runbook."""
    if not _RUNBOOK.fullmatch(name):
        return None
    source = importlib.resources.files("fleetward.runbooks") / f"{name}.md"
    if not source.is_file():
        return None
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(source.read_text(encoding="utf-8"))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(name)} runbook</title>"
            "<style>body{font:15px/1.5 system-ui,sans-serif;max-width:52rem;margin:2rem auto;padding:0 1rem}"
            "pre,code{background:#f4f4f4}pre{padding:.6rem;overflow-x:auto}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:.2rem .5rem}</style></head>"
            f"<body><p><a href='/'>← fleet page</a></p>{body}</body></html>")
