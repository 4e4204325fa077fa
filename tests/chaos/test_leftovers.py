"""What a process leaves outside itself names its owner (fleet/claims.py), and what a dead owner left is found and
removed (chaos/leftovers.py: the folder kind here; the others are proven as processes in test_runguard.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fleetward.chaos.leftovers import Reclaimed, _remove_folders
from fleetward.fleet.claims import Owner, claim, claims, release


@pytest.fixture
def claims_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "claims"
    monkeypatch.setenv("FLEETWARD_CLAIMS_DIR", str(folder))
    return folder


def _dead_owner() -> Owner:
    """A process that ran and was reaped: its pid and start time name nobody now."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    owner = Owner.of(p.pid)
    p.kill()
    p.wait()
    return owner


def test_a_claim_names_its_owner_until_released(claims_dir: Path) -> None:
    claim("iptables", "FW-x/y")  # any name, even with a slash
    assert claims("iptables") == {"FW-x/y": Owner.of()} and Owner.of().alive
    release("iptables", "FW-x/y")
    assert claims("iptables") == {}
    assert claims("cgroup") == {}, "a kind nothing ever claimed"
    dead = _dead_owner()
    claim("netns", "fwabc123-", dead)
    assert claims("netns") == {"fwabc123-": dead} and not dead.alive


def test_a_folder_claimed_by_a_dead_owner_is_removed_and_a_living_one_s_is_kept(
        claims_dir: Path, tmp_path: Path) -> None:
    left, kept = tmp_path / "left", tmp_path / "kept"
    for folder in (left, kept):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "state").write_text("3")
    claim("folder", str(left), _dead_owner())
    claim("folder", str(kept))
    out = Reclaimed()
    _remove_folders([], out)
    assert (out.folders, left.exists(), kept.exists()) == ([str(left)], False, True)
    assert set(claims("folder") or {}) == {str(kept)}, "released once removed"


def test_claims_another_user_could_have_written_are_not_read_and_spare_everything(
        claims_dir: Path, tmp_path: Path) -> None:
    """A reclaim removes what a claim names, and what nobody claimed: claims that others may have written are
    not read, and nothing is taken for unclaimed while they cannot be trusted."""
    from fleetward.chaos.leftovers import _owned_by_the_living

    victim = tmp_path / "victim"
    victim.mkdir()
    claim("folder", str(victim), _dead_owner())
    assert (claims_dir.stat().st_mode & 0o777, (claims_dir / "folder").stat().st_mode & 0o777) == (0o700, 0o700)
    (claims_dir / "folder").chmod(0o777)
    assert claims("folder") is None
    _remove_folders([], Reclaimed())
    assert victim.exists()
    assert _owned_by_the_living("FW-unclaimed", None), "untrusted claims spare what looks unclaimed"
