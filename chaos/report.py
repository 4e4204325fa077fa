"""``report.html``: one self-contained page per run (inline SVG plots, no external assets).

What it shows: the verdict and exit code, the steady-state probes before and after, the fault schedule as
it happened (targets, verified, recovered), every checker's verdict with its details, and plots: token
throughput over time with the fault windows shaded and migrations marked, TTFT and ITL distributions
(fault-free baseline against requests that overlapped a fault), recovery and detection times, and the RSS and
open file descriptors of the routers, controllers and the runner (which hosts the node agent) over time.
"""

from __future__ import annotations

import html
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetward.chaos.checkers import Verdict
from fleetward.chaos.history import Record, read_history
from fleetward.chaos.runview import RunView, token_times

__all__ = ["save_plots", "write_report"]

_COLORS = {"pass": "#1a7f37", "unknown": "#9a6700", "fail": "#cf222e", "completed": "#1a7f37",
           "failed": "#cf222e", "aborted": "#cf222e", "interrupted": "#9a6700"}
_FAULT_COLORS = ["#fd8c73", "#a475f9", "#54aeff", "#4ac26b", "#d4a72c", "#ff80c8", "#8c959f", "#0d9488"]

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;
color:#1f2328;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #d0d7de;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0;width:100%}td,th{border:1px solid #d0d7de;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f6f8fa}.badge{display:inline-block;padding:1px 8px;border-radius:
10px;color:#fff;font-weight:600;font-size:.9em}code,pre{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}
pre{background:#f6f8fa;padding:8px;overflow:auto;max-height:400px}.muted{color:#656d76}
details summary{cursor:pointer}figure{margin:1em 0}svg{max-width:100%;height:auto}
"""


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _badge(status: str) -> str:
    return f'<span class="badge" style="background:{_COLORS.get(status, "#656d76")}">{_e(status)}</span>'


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    h = "".join(f"<th>{_e(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


# -- plots --------------------------------------------------------------------------------------------------


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _shade(ax: Any, view: RunView, t0: float, width: float) -> None:
    """Fault windows as shaded spans: one legend entry each, or one per fault when there are many (a soak)."""
    windows = [f for f in view.faults if not f.refused]
    grouped = len(windows) > len(_FAULT_COLORS)
    kinds = list(dict.fromkeys(w.fault for w in windows))
    labelled: set[str] = set()
    for i, w in enumerate(windows):
        color = _FAULT_COLORS[(kinds.index(w.fault) if grouped else i) % len(_FAULT_COLORS)]
        if grouped:
            times = sum(1 for x in windows if x.fault == w.fault)
            label = None if w.fault in labelled else f"{w.fault} ({'once' if times == 1 else f'{times} times'})"
            labelled.add(w.fault)
        else:
            label = f"{w.activity} ({', '.join(w.targets)[:30]})"
        ax.axvspan(w.start - t0, max(w.end - t0, w.start - t0 + width / 3), color=color, alpha=0.25, label=label)


def _resource_series(view: RunView) -> dict[str, list[tuple[float, float, int]]]:
    """(t, RSS MB, fds) over time of the router(s), controller(s), agent and runner (a restart continues the line)."""
    out: dict[str, list[tuple[float, float, int]]] = {}
    for r in view.records:
        if r.type != "resources" or r.get("phase") not in ("sample", "end"):
            continue
        for p in r.get("procs") or ():
            if p.get("role") in ("router", "controller", "agent", "runner"):
                name = "runner (agent)" if p["role"] == "runner" else f"{p['role']} {p['id']}"
                out.setdefault(name, []).append((r.t, float(p["rss_mb"]), int(p["fds"])))
    return out


def _resources(view: RunView) -> Any:
    """RSS and open fds over time (a matplotlib figure), fault windows shaded; None without samples."""
    import matplotlib.pyplot as plt

    series = _resource_series(view)
    if not series or view.method is None:
        return None
    t0, t1 = view.method
    last = max(t for pts in series.values() for t, *_ in pts)
    span = max(last - t0, t1 - t0, 1e-3)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.6), sharex=True)
    for k, (name, pts) in enumerate(sorted(series.items())):
        color = f"C{k % 10}"
        top.plot([t - t0 for t, *_ in pts], [m for _, m, _ in pts], color=color, lw=1.2, label=name)
        bottom.plot([t - t0 for t, *_ in pts], [f for *_, f in pts], color=color, lw=1.2, label=name)
    for ax in (top, bottom):
        _shade(ax, view, t0, span / 150)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    top.set_ylabel("RSS (MB)")
    bottom.set_ylabel("open fds")
    bottom.set_xlabel("seconds into the method (after its end: the after-hypothesis and rollbacks)")
    top.set_xlim(min(0.0, min(t for pts in series.values() for t, *_ in pts) - t0), span)
    bottom.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), fontsize=8, ncol=4, frameon=False)
    return fig


def _throughput(view: RunView) -> str | None:
    fig = _throughput_figure(view)
    return None if fig is None else _svg(fig)


def _throughput_figure(view: RunView) -> Any:
    import matplotlib.pyplot as plt

    if view.method is None:
        return None
    t0, t1 = view.method
    times, counts = token_times(view)
    span = max(t1 - t0, 1e-3)
    width = max(0.1, span / 150)
    n = int(span / width) + 1
    bins = [0.0] * n
    for t, c in zip(times, counts, strict=True):
        k = int((t - t0) / width)
        if 0 <= k < n:
            bins[k] += c / width
    fig, ax = plt.subplots(figsize=(10, 3.4))
    ax.plot([i * width for i in range(n)], bins, drawstyle="steps-post", color="#0969da", lw=1.2,
            label="tokens/s delivered")
    _shade(ax, view, t0, width)
    # Markers sit in axes coordinates (x in seconds, y as a share of the height): never clipped.
    along = ax.get_xaxis_transform()
    migrations = [t - t0 for t, ev in view.events if ev.get("kind") == "migration" and t0 <= t <= t1]
    if migrations:
        ax.vlines(migrations, 0, 0.07, transform=along, color="#cf222e", lw=1.2, label="migration")
    detections = [t - t0 for t, ev in view.events if ev.get("kind") in ("hang.detected", "health.changed",
                                                                          "worker.down", "quarantine")
                  and ev.get("state") not in ("ready", "starting") and t0 <= t <= t1]
    if detections:
        ax.plot(detections, [0.95] * len(detections), "v", transform=along, color="#9a6700", ms=7,
                label="detection")
    ax.set_xlabel("seconds into the method")
    ax.set_ylabel("tokens / s")
    ax.set_xlim(0, span)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, ncol=4, frameon=False)
    return fig


def _split(view: RunView, settle: float = 1.0) -> tuple[list[Any], list[Any]]:
    base: list[Any] = []
    faulty: list[Any] = []
    for r in view.workload_requests():
        (faulty if view.faults_of(r, settle) else base).append(r)
    return base, faulty


def _cdfs(view: RunView) -> str | None:
    import matplotlib.pyplot as plt

    base, faulty = _split(view)
    series = {
        "TTFT": {"baseline": [r.ttft for r in base if r.ttft is not None],
                 "overlapping a fault": [r.ttft for r in faulty if r.ttft is not None]},
        "inter-token latency": {"baseline": [x for r in base for x in r.itls()],
                                "overlapping a fault": [x for r in faulty for x in r.itls()]},
    }
    if not any(v for s in series.values() for v in s.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for ax, (title, groups) in zip(axes, series.items(), strict=True):
        for (name, values), color in zip(groups.items(), ("#0969da", "#cf222e"), strict=True):
            if not values:
                continue
            xs = sorted(v * 1000 for v in values)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", color=color, label=f"{name} (n={len(xs)})")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylabel("share ≤ x")
        ax.set_xscale("symlog", linthresh=1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    return _svg(fig)


def _times(verdicts: Sequence[Verdict]) -> str | None:
    import matplotlib.pyplot as plt

    rows: list[tuple[str, str, float]] = []
    for v in verdicts:
        key = {"recovery": "recovery_s", "detection": "latency_s"}.get(v.checker)
        for name, value in ((v.metrics or {}).get(key) or {}).items() if key else ():
            if value is not None:
                rows.append((v.checker, name, float(value)))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.35 * len(rows)))
    labels = [f"{name} ({'recovery' if c == 'recovery' else 'detection'})" for c, name, _ in rows]
    bars = ax.barh(range(len(rows)), [x for *_, x in rows], color=["#4ac26b" if c == "recovery" else "#a475f9"
                                                                  for c, *_ in rows])
    ax.bar_label(bars, labels=[f"{x:.2f} s" for *_, x in rows], padding=3, fontsize=8)
    ax.set_xlim(0, max(0.5, max(x for *_, x in rows) * 1.2))
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.grid(alpha=0.3, axis="x")
    return _svg(fig)


def _plots(view: RunView, verdicts: Sequence[Verdict]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return '<p class="muted">plots need matplotlib (pip install matplotlib)</p>'
    parts = []
    def resources() -> str | None:
        fig = _resources(view)
        return None if fig is None else _svg(fig)

    for title, make in (("Token throughput", lambda: _throughput(view)), ("Latency distributions", lambda: _cdfs(view)),
                        ("Recovery and detection times", lambda: _times(verdicts)),
                        ("Memory (RSS) and open file descriptors of the fleet's processes", resources)):
        svg = make()
        if svg:
            parts.append(f"<figure><figcaption><b>{_e(title)}</b></figcaption>{svg}</figure>")
    return "".join(parts) or '<p class="muted">no data to plot</p>'


def save_plots(run_dir: Path, out: Path, prefix: str) -> list[Path]:
    """The run's token throughput and resources plots as PNG files ``<out>/<prefix>-throughput.png`` and
    ``<prefix>-resources.png`` (for documentation: the report itself inlines them as SVG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    view = RunView.of(read_history(run_dir / "history.jsonl"))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in (("throughput", _throughput_figure), ("resources", _resources)):
        fig = make(view)
        if fig is None:
            continue
        path = out / f"{prefix}-{name}.png"
        fig.savefig(path, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


# -- the page -----------------------------------------------------------------------------------------------


def _probes(state: Mapping[str, Any] | None) -> str:
    if not state:
        return '<p class="muted">not checked</p>'
    rows = [[_e(p["activity"]["name"]), _e(p["activity"]["probe"]), f"<code>{_e(json.dumps(p['output']))}</code>",
             f"<code>{_e(json.dumps(p['activity']['tolerance']))}</code>",
             _badge("pass" if p["tolerance_met"] else "fail") + (f" {_e(p['exception'])}" if p.get("exception")
                                                                  else "")]
            for p in state.get("probes", [])]
    met = _badge("pass" if state.get("steady_state_met") else "fail")
    return f"<p>{_e(state.get('title'))}: {met}</p>" + _table(["probe", "kind", "value", "tolerance", ""], rows)


def _activities(journal: Mapping[str, Any], view: RunView) -> str:
    t0 = view.method[0] if view.method else 0.0

    def at(t: Any) -> str:
        return f"{t - t0:.2f}" if isinstance(t, (int, float)) else "-"

    rows = []
    for a in journal.get("run") or []:
        act, out = a["activity"], a.get("output") or {}
        rows.append([_e(act.get("name")), _e(act.get("fault")), _e(", ".join(out.get("targets") or [])),
                     at(a.get("t_start")), at(a.get("t_end")), _e(out.get("verified")), _e(out.get("recovered")),
                     _badge("pass" if a.get("status") == "succeeded" else "fail") + " " + _e(a.get("status"))
                     + (f"<br><span class='muted'>{_e(a.get('exception'))}</span>" if a.get("exception") else "")])
    if not rows:
        return '<p class="muted">no faults: a baseline run</p>'
    return _table(["activity", "fault", "targets", "start (s into the method)", "end (s)", "verified", "recovered",
                   "status"], rows)


def _verdicts(verdicts: Sequence[Verdict]) -> str:
    out = []
    for v in verdicts:
        details = ""
        if v.details:
            items = "".join(f"<li><code>{_e(d.get('text') or json.dumps(d, default=str))}</code></li>"
                            for d in v.details[:100])
            more = f"<p class='muted'>{len(v.details) - 100} more in journal.json</p>" if len(v.details) > 100 else ""
            details = f"<details><summary>{len(v.details)} detail(s)</summary><ul>{items}</ul>{more}</details>"
        metrics = f"<details><summary>metrics</summary><pre>{_e(json.dumps(v.metrics, indent=1, default=str))}" \
                  f"</pre></details>" if v.metrics else ""
        out.append([_e(v.checker), _badge(v.status), _e(v.summary) + details + metrics])
    return _table(["checker", "verdict", "what it found"], out)


def write_report(run_dir: Path, journal: Mapping[str, Any], records: Sequence[Record],
                 verdicts: Sequence[Verdict]) -> Path:
    view = RunView.of(records)
    exp = journal.get("experiment") or {}
    fleet = journal.get("fleet") or {}
    wl = journal.get("workload") or {}
    checks = (journal.get("checks") or {}).get("status", "unknown")
    head = _table(["run", "hypothesis", "checks", "exit code", "duration", "fleet", "reference"], [[
        _badge(str(journal.get("status"))) + (f"<br><span class='muted'>{_e(journal.get('reason'))}</span>"
                                              if journal.get("reason") else ""),
        _badge("fail" if journal.get("deviated") else "pass") + (" deviated" if journal.get("deviated") else ""),
        _badge(str(checks)), _e(journal.get("exit_code")), f"{_e(journal.get('duration'))} s",
        _e(f"{fleet.get('backend')}: {len(fleet.get('workers') or [])} worker(s), "
           f"{len(fleet.get('routers') or [])} router(s), cluster {fleet.get('cluster')}"),
        _e((journal.get("reference") or {}).get("kind")),
    ]])
    workload = _table(["planned", "sent", "ok", "failed", "cancelled", "shed", "tokens", "by source"], [[
        _e(wl.get("planned")), _e(wl.get("sent")), _e(wl.get("ok")), _e(wl.get("failed")), _e(wl.get("cancelled")),
        _e(wl.get("shed")), _e(wl.get("tokens")), _e(", ".join(f"{k}: {v}" for k, v in (wl.get("by_source") or {})
                                                              .items()))]])
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{_e(exp.get('title'))} — fleetward chaos</title>
<style>{_CSS}</style></head><body>
<h1>{_e(exp.get('title'))}</h1><p class="muted">{_e(exp.get('description'))}</p>
<p class="muted">{_e(journal.get('start'))} · seed {_e(exp.get('seed'))} · files:
<a href="journal.json">journal.json</a>, <a href="history.jsonl">history.jsonl</a></p>
{head}
<h2>Checks</h2>{_verdicts(verdicts)}
<h2>Plots</h2>{_plots(view, verdicts)}
<h2>Steady state before</h2>{_probes((journal.get('steady_states') or {}).get('before'))}
<h2>Method</h2>{_activities(journal, view)}
<h2>Workload</h2>{workload}
<h2>Steady state after</h2>{_probes((journal.get('steady_states') or {}).get('after'))}
<h2>Experiment</h2><details><summary>as run</summary><pre>{_e(json.dumps(exp, indent=1))}</pre></details>
</body></html>
"""
    path = run_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
