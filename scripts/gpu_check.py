"""fleetward's GPU health path on a real NVIDIA GPU, in one run (``scripts/gpu-check.sh`` starts it).

It starts what an operator would: a local fleet (``fleetward up``: etcd, a broker, a controller, a router, the
node agent with ``gpu: nvml`` and one simulated worker, given GPU 0), and beside it a server fleetward did not
start that holds a CUDA context on GPU 0 (a simulated worker whose process first creates one), adopted by
pidfile. It then prints, and checks:

1. what NVML reports (``fleetward gpu --json --source nvml``: the GPUs, their health by the policy);
2. the worker<->GPU mapping: the started worker by the device it was given, the adopted server by NVML's
   compute processes against its process tree (``workers/<id>`` records, and ``fleetward gpu``);
3. the self-test's result and time on each GPU (``fleetward gpu --self-test``);
4. the agent's detector verdicts for each worker (``signals/<worker>/<detector>`` in etcd) and the GPU source
   it announced (``fleetward status``).

Exit status 0 when every check passed, 1 when any is missing or failed (the summary names it). Everything it
started is stopped, whatever happens: on SIGTERM or SIGHUP it stops them as on Ctrl-C, and if it is killed
(SIGKILL, a device's timeout) they get a parent-death signal (the fleet SIGTERM, to stop in order; the holder
SIGKILL). ``--no-cuda-context`` runs the same path where there is no CUDA (the
tests run it so over a fake of NVML's bindings; the self-test then fails, as it must).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fleetward.fleet.procs import dies_with_parent

FLEETWARD = [sys.executable, "-m", "fleetward.cli"]
CLUSTER = "gpucheck"
NODE = "gpucheck"
ENV = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}

# A server that holds a CUDA context on the GPU it sees, then serves as the simulated worker does.
HOLDER = """
import os, runpy, sys
if os.environ.get("GPU_CHECK_CUDA") == "1":
    import torch
    torch.cuda.init()
    held = torch.ones(1024, device="cuda")  # a context and a little memory, for as long as it serves
    print("holding a CUDA context on", torch.cuda.get_device_name(0), flush=True)
open(sys.argv[1], "w").write(str(os.getpid()))
sys.argv = ["fleetward.sim.server", "--host", "127.0.0.1", "--port", sys.argv[2]]
runpy.run_module("fleetward.sim.server", run_name="__main__")
"""


class Check:
    def __init__(self) -> None:
        self.results: list[tuple[str, bool, str]] = []

    def __call__(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results.append((name, ok, detail))
        print(f"[{'ok' if ok else 'FAILED'}] {name}{': ' + detail if detail else ''}", flush=True)
        return ok

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(ok for _, ok, _ in self.results)


def section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def fleetward(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    print("$ fleetward " + " ".join(shlex.quote(a) for a in args), flush=True)
    return subprocess.run([*FLEETWARD, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_on(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # as Ctrl-C does: the finally below stops what was started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu-check"), help="where the run's files and logs go")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds to wait for the fleet to be ready")
    p.add_argument("--no-cuda-context", dest="cuda", action="store_false",
                   help="do not create a CUDA context in the adopted server (a host without CUDA)")
    args = p.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Check()
    started = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_on)
    try:
        run(args, out, check, procs)
    except Exception as exc:  # a check that could not even run is a failed check, with why
        check("the check ran to its end", False, f"{type(exc).__name__}: {exc}")
    finally:
        for proc in reversed(procs):
            stop(proc)
    section(f"summary ({time.monotonic() - started:.0f} s)")
    for name, ok, detail in check.results:
        print(f"  {'ok    ' if ok else 'FAILED'} {name}" + (f" ({detail})" if detail and not ok else ""))
    print("GPU CHECK " + ("PASSED" if check.passed else "FAILED"), flush=True)
    return 0 if check.passed else 1


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, then SIGKILL what is left of it."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run(args: argparse.Namespace, out: Path, check: Check, procs: list[subprocess.Popen[bytes]]) -> None:
    section("1. what NVML reports")
    r = fleetward("gpu", "--json", "--source", "nvml")
    print(r.stdout or r.stderr, flush=True)
    nvml = json.loads(r.stdout) if r.stdout.strip() else {"gpus": []}
    if not check("NVML lists the GPUs", bool(nvml["gpus"]), r.stderr.strip()[-300:]):
        return

    section("2. a fleet with gpu: nvml, and a server holding a CUDA context on GPU 0")
    port = free_port()
    pidfile = out / "cuda-worker.pid"
    pidfile.unlink(missing_ok=True)
    holder_env = {**ENV, "GPU_CHECK_CUDA": "1" if args.cuda else "0", "CUDA_VISIBLE_DEVICES": nvml["gpus"][0]["uuid"]}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(pidfile), str(port)], env=holder_env,
                              stdout=open(out / "cuda-worker.log", "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True, preexec_fn=dies_with_parent(signal.SIGKILL))
    procs.append(holder)
    fleet_file = out / "fleet.yaml"
    fleet_file.write_text(json.dumps({  # JSON is YAML
        "cluster": CLUSTER, "node": NODE, "workers": 1, "run_dir": str(out / "run"), "gpu": "nvml",
        "supervisor": {"gpu_poll_interval_s": 0.5},
        "attach": [{"url": f"http://127.0.0.1:{port}", "id": "cuda-worker", "process": {"pidfile": str(pidfile)}}],
    }, indent=2))
    print(fleet_file.read_text(), flush=True)
    up = subprocess.Popen([*FLEETWARD, "up", "--config", str(fleet_file)], env=ENV, start_new_session=True,
                          stdout=open(out / "up.log", "wb"), stderr=subprocess.STDOUT,
                          preexec_fn=dies_with_parent(signal.SIGTERM))
    procs.append(up)
    where = ("--config", str(fleet_file))
    deadline = time.monotonic() + args.timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if up.poll() is not None or holder.poll() is not None:
            break
        r = subprocess.run([*FLEETWARD, "status", "--json", *where], capture_output=True, text=True, env=ENV)
        status = json.loads(r.stdout) if r.returncode == 0 else {}
        ready = {w["id"] for w in status.get("workers", []) if w["health"] == "ready"}
        if {f"{NODE}-w0", "cuda-worker"} <= ready:
            break
        time.sleep(1.0)
    ready = {w["id"] for w in status.get("workers", []) if w["health"] == "ready"}
    if not check("the fleet and the adopted CUDA server are ready", {f"{NODE}-w0", "cuda-worker"} <= ready,
                 f"ready: {sorted(ready)}; see {out}/up.log and {out}/cuda-worker.log"):
        return
    print(fleetward("status", *where).stdout, flush=True)
    agents = [a for a in status.get("agents", []) if a.get("node") == NODE]
    check("the agent announced its GPU source: nvml", bool(agents) and agents[0]["gpu"]["source"] == "nvml",
          json.dumps(agents))

    section("3. the worker<->GPU mapping and the self-test")
    r = fleetward("gpu", "--json", "--self-test", *where)
    print(r.stdout or r.stderr, flush=True)
    report = json.loads(r.stdout) if r.stdout.strip() else {"gpus": []}
    gpu0 = next((g for g in report["gpus"] if g["index"] == 0), None)
    if not check("fleetward gpu reports GPU 0", gpu0 is not None, r.stderr.strip()[-300:]):
        return
    assert gpu0 is not None
    check("GPU 0 is healthy by the policy", gpu0["health"] == "ok", "; ".join(gpu0["reasons"]))
    holder_pid = int(pidfile.read_text()) if pidfile.exists() else -1
    check("NVML lists the adopted server's process on GPU 0", holder_pid in gpu0["processes"],
          f"pid {holder_pid}; NVML: {gpu0['processes']}")
    check("GPU 0 maps to both workers", {f"{NODE}-w0", "cuda-worker"} <= set(gpu0["workers"]), str(gpu0["workers"]))
    for g in report["gpus"]:
        st = g["selftest"] or {}
        check(f"self-test on GPU {g['index']} ({g['name']})", bool(st.get("passed")),
              f"{st.get('reason')} in {st.get('seconds')} s")
    r = fleetward("gpu", *where)
    print(r.stdout, flush=True)

    section("4. the records and the detectors' verdicts")
    records, signals = asyncio.run(read_etcd(out / "run"))
    for wid in (f"{NODE}-w0", "cuda-worker"):
        rec = records.get(wid, {})
        print(f"{wid}: workers/{wid} gpus={rec.get('gpus')} device={rec.get('device')!r}")
        for detector, sig in sorted(signals.get(wid, {}).items()):
            print(f"    {detector:>14}: {sig.get('severity')}: {sig.get('reason')}")
        check(f"{wid} is registered on GPU 0", rec.get("gpus") == [0], str(rec.get("gpus")))
        gpu_sig = signals.get(wid, {}).get("gpu", {})
        watched = gpu_sig.get("severity") == "ok" and "nvml" in gpu_sig.get("reason", "")
        check(f"the gpu detector watches {wid}", watched, str(gpu_sig))


async def read_etcd(run_dir: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    from fleetward.fleet.etcd import EtcdStore
    from fleetward.fleet.keys import Keys

    state = json.loads((run_dir / CLUSTER / "fleet.json").read_text())
    keys = Keys(CLUSTER)
    async with EtcdStore(state["etcd"]) as store:
        listed = (await store.get_prefix(keys.workers)).items
        workers = {kv.key[len(keys.workers):]: json.loads(kv.value) for kv in listed}
        signals: dict[str, dict[str, Any]] = {}
        for kv in (await store.get_prefix(keys.signals)).items:
            wid, _, detector = kv.key[len(keys.signals):].partition("/")
            signals.setdefault(wid, {})[detector] = json.loads(kv.value)
    return workers, signals


if __name__ == "__main__":
    sys.exit(main())
