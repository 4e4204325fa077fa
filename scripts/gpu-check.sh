#!/usr/bin/env bash
# fleetward's GPU health path on a real NVIDIA GPU, in one run of a few minutes (docs/operations.md, "GPU health").
#
#   scripts/gpu-check.sh --download DIR          where there is a network: fleetward's wheel and its dependencies'
#                                                for Python 3.12 on x86-64 Linux into DIR, to bring along
#   scripts/gpu-check.sh --wheels DIR [--out D]  on the GPU machine (no network; Python 3.12 with torch and
#                                                nvidia-ml-py installed): a venv beside the system's packages,
#                                                fleetward installed from DIR alone, then the check
#   scripts/gpu-check.sh [--out D]               the check with $PYTHON (default python3), which has fleetward
#
# The check (scripts/gpu_check.py) starts etcd, a broker (Mosquitto where installed, else the embedded one), a node
# agent with gpu: nvml and one worker, and a server holding a CUDA context on GPU 0; it prints what NVML reports,
# the worker<->GPU mapping, the self-test's result and time, and the agent's detector verdicts, and exits non-zero
# when any of that is missing. Extra arguments after -- go to gpu_check.py (--no-cuda-context: a host without CUDA).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
PY=${PYTHON:-python3}
wheels="" download="" out="gpu-check" extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) wheels="$2"; shift 2 ;;
        --download) download="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

# Only what the check runs, so that the wheels and this repository fit what a GPU machine without network is
# sent (64 MiB; about 48 MB of wheels): the autoscaler's forecasting (statsmodels, scipy, pandas), the plots
# (matplotlib), TLS certificates (cryptography), the hub's downloads (hf_xet) and syntax colours (pygments)
# stay behind; torch, numpy and nvidia-ml-py are on the machine already.
LEAVE="scipy statsmodels pandas patsy formulaic interface_meta narwhals matplotlib pillow fonttools kiwisolver
contourpy cycler pyparsing python_dateutil tzdata cryptography hf_xet pygments numpy torch
nvidia_ml_py triton"

if [ -n "$download" ]; then
    mkdir -p "$download"
    had_build=$([ -d "$root/build" ] && echo 1 || true)
    "$PY" -m pip wheel --quiet --no-deps --wheel-dir "$download" "$root"
    [ -n "$had_build" ] || rm -rf "$root/build"  # setuptools' scratch folder, in the checkout
    "$PY" -m pip download --quiet --dest "$download" --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        --platform linux_x86_64 --platform any \
        "$(ls "$download"/fleetward-*.whl | head -n1)[embedded-broker]"
    for name in $LEAVE; do rm -f "$download/$name"-*.whl; done
    rm -f "$download"/nvidia_*.whl
    du -sh "$download"
    exit 0
fi

if [ -n "$wheels" ]; then
    venv="${GPU_CHECK_VENV:-$out/venv}"
    mkdir -p "$out"
    if [ ! -x "$venv/bin/python" ]; then
        "$PY" -m venv --system-site-packages "$venv"  # the system's torch and nvidia-ml-py stay visible
    fi
    # Every wheel brought, none fetched: --no-deps, since the ones left behind are not needed here.
    "$venv/bin/python" -m pip install --quiet --no-index --no-deps "$wheels"/*.whl
    # The same version number from another checkout is still another fleetward: this one, always.
    "$venv/bin/python" -m pip install --quiet --no-index --no-deps --force-reinstall "$wheels"/fleetward-*.whl
    PY="$venv/bin/python"
fi

"$PY" -c 'import fleetward' 2>/dev/null || {
    echo "gpu-check: $PY cannot import fleetward: pass --wheels DIR (made with --download), or set PYTHON" >&2
    exit 2
}
"$PY" -c 'import numpy' 2>/dev/null || {
    echo "gpu-check: $PY has no numpy (torch installs usually bring it): pip install numpy, or bring its wheel" >&2
    exit 2
}
"$PY" -c 'import pynvml' 2>/dev/null || echo "gpu-check: warning: no nvidia-ml-py for $PY: NVML cannot be read" >&2
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || echo "gpu-check: nvidia-smi lists no GPU" >&2
exec "$PY" "$here/gpu_check.py" --out "$out" "${extra[@]}"
