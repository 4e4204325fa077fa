"""The layout is the architecture: every folder ships, and dependencies point the way docs/architecture.md says."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_source_folder_is_a_listed_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {folder: pkg for pkg, folder in config["package-dir"].items()}
    for init in ROOT.glob("*/__init__.py"):
        folder = init.parent.name
        assert folder in mapped, f"{folder}/ is not mapped in [tool.setuptools.package-dir]"
        assert mapped[folder] in config["packages"], f"{mapped[folder]} is missing from packages: not in the wheel"
    for pkg in config["packages"]:
        assert pkg.startswith("fleetward."), "nothing installs a top-level module but fleetward"


MAX_LINES = 1000


def test_no_module_is_over_1000_lines() -> None:
    """A module does one job; one that passes 1,000 lines has grown a second (docs/architecture.md)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = [ROOT / folder for folder in config["package-dir"].values()] + [ROOT / "tests"]
    over = {str(f.relative_to(ROOT)): n for folder in folders for f in folder.rglob("*.py")
            if "node_modules" not in f.parts and (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them along their seams): {over}"


def test_subpackages_depend_only_the_way_the_design_allows() -> None:
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    result = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _unreachable_index() -> dict[str, str]:
    """An environment in which pip's only package index refuses connections (no config file, no local wheels)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    return {**env, "PIP_INDEX_URL": f"http://127.0.0.1:{port}/simple", "PIP_CONFIG_FILE": os.devnull,
            "PIP_RETRIES": "0", "PIP_DEFAULT_TIMEOUT": "5"}


def test_dev_setup_with_fewer_extras_than_installed_changes_nothing_says_nothing_and_fetches_nothing() -> None:
    """`./dev test` installs the most extras; `./dev up` or `./dev setup` after it must not reinstall (they
    used to, alternately, each time) nor print anything when all is in place, nor reach a registry: with the
    package index unreachable it still has nothing to do."""
    venv = Path(sys.prefix)
    stamp = venv / ".fleetward-installed"
    if not stamp.exists():
        pytest.skip("this venv was not set up by ./dev")
    before = stamp.read_text()
    result = subprocess.run([str(ROOT / "dev"), "setup"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**_unreachable_index(), "FLEETWARD_VENV": str(venv)})
    assert result.returncode == 0, result.stderr
    assert (result.stdout, result.stderr) == ("", ""), "nothing to do, nothing said"
    assert stamp.read_text() == before


def test_dev_setup_with_the_package_index_unreachable_names_what_it_could_not_fetch(tmp_path: Path) -> None:
    """A fresh machine whose package index is down: `./dev` fails within its bounded retries, without a prompt,
    and says what it could not fetch from where."""
    env = {**_unreachable_index(), "FLEETWARD_VENV": str(tmp_path / "venv")}
    result = subprocess.run([str(ROOT / "dev"), "setup"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stderr
    assert f"could not fetch from the package index ({env['PIP_INDEX_URL']}):" in result.stderr, result.stderr
    assert "No matching distribution found for setuptools" in result.stderr, result.stderr
    assert "installing failed; the whole log is" in result.stderr


@pytest.mark.parametrize(("smi", "args", "extras"), [
    ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5e1c8f3a-0000-4000-8000-000000000000)", ["--backend", "vllm"],
     "model,gpu,vllm"),
    ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5e1c8f3a-0000-4000-8000-000000000000)", [], "model,gpu"),
    (None, ["--backend=vllm"], "model,vllm-cpu"),
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", ["--backend", "vllm"],
     "model,vllm-cpu"),
])
def test_dev_up_installs_vllms_cuda_build_only_where_nvidia_smi_lists_a_gpu(
        tmp_path: Path, smi: str | None, args: list[str], extras: str) -> None:
    """What `./dev up ARGS` installs (`./dev extras` says it without installing): on a GPU host NVML's bindings,
    and for --backend vllm vLLM's CUDA build; elsewhere its CPU build."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho '{smi}'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    others = [p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists()]
    path = ":".join([str(bin_dir), *others])
    r = subprocess.run([str(ROOT / "dev"), "extras", "up", *args], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "PATH": path})
    assert (r.returncode, r.stdout.strip()) == (0, extras), r.stderr


def test_the_shipped_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: systemd)")
    fleetward = Path(sys.executable).with_name("fleetward")
    units = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
    assert len(units) == 4
    for unit in units:  # ExecStart must name an executable here; the rest as shipped
        (tmp_path / unit.name).write_text(unit.read_text().replace("/opt/fleetward/.venv/bin/fleetward",
                                                                   str(fleetward)))
    r = subprocess.run([analyze, "verify", *sorted(str(p) for p in tmp_path.glob("*.service"))],
                       capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stdout + r.stderr
    for unit in units:
        text = unit.read_text()
        if "DynamicUser=yes" in text and "--admin-token-file %d/admin-token" in text:
            assert "LoadCredential=admin-token:/etc/fleetward/admin-token" in text, unit.name
