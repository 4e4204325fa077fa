"""The KV-folder check fleetward's vLLM connector runs before a decode server loads another server's KV
(fleetward.fleet.kv.check_folder; the connector itself is tested on real vLLM in tests/vllm/test_a_pd_on_vllm.py).
Each fault is one docs/pd.md found vLLM's own connector loading (wrong tokens) or dying on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fleetward.fleet.kv import MANIFEST, check_folder, write_manifest

LAYERS = [f"model.layers.{i}.self_attn.attn.safetensors" for i in range(3)]


def kv_folder(root: Path, name: str, seed: int) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for i, layer in enumerate(LAYERS):
        (folder / layer).write_bytes(bytes((seed + i + j) % 251 for j in range(4096)))
    write_manifest(folder, 256)
    return folder


def test_a_folder_as_the_producer_wrote_it_passes(tmp_path: Path) -> None:
    assert check_folder(kv_folder(tmp_path, "a" * 32, 1), 256) is None


def corrupt(folder: Path, other: Path) -> None:
    layer = folder / LAYERS[1]
    data = bytearray(layer.read_bytes())
    data[100] ^= 0x01  # one bit: same size, still a loadable file
    layer.write_bytes(bytes(data))


def stale(folder: Path, other: Path) -> None:
    for p in folder.iterdir():
        p.unlink()
    for p in other.iterdir():
        shutil.copy(p, folder / p.name)


def stale_files_only(folder: Path, other: Path) -> None:
    for layer in LAYERS:
        shutil.copy(other / layer, folder / layer)


def zeroed(folder: Path, other: Path) -> None:
    layer = folder / LAYERS[0]
    layer.write_bytes(bytes(layer.stat().st_size))


def truncated(folder: Path, other: Path) -> None:
    layer = folder / LAYERS[2]
    layer.write_bytes(layer.read_bytes()[:1000])


def partial(folder: Path, other: Path) -> None:
    (folder / LAYERS[2]).unlink()


def unfinished(folder: Path, other: Path) -> None:
    (folder / MANIFEST).unlink()


def extra_layer(folder: Path, other: Path) -> None:
    shutil.copy(folder / LAYERS[0], folder / "model.layers.9.self_attn.attn.safetensors")


@pytest.mark.parametrize(("fault", "kind"), [
    (corrupt, "checksum"), (stale, "digest"), (stale_files_only, "checksum"), (zeroed, "checksum"),
    (truncated, "checksum"), (partial, "truncated"), (unfinished, "incomplete"), (extra_layer, "digest")])
def test_every_file_fault_is_refused_with_its_kind(tmp_path: Path, fault: object, kind: str) -> None:
    folder = kv_folder(tmp_path, "b" * 32, 2)
    other = kv_folder(tmp_path, "c" * 32, 3)
    fault(folder, other)  # type: ignore[operator]
    why = check_folder(folder, 256)
    assert why is not None and why[0] == kind, why


def test_a_folder_checked_for_another_token_count_is_refused(tmp_path: Path) -> None:
    folder = kv_folder(tmp_path, "d" * 32, 4)
    why = check_folder(folder, 128)
    assert why is not None and why[0] == "digest" and "256 tokens" in why[1]
    (folder / MANIFEST).write_text("{not json")
    why = check_folder(folder, 256)
    assert why is not None and why[0] == "incomplete"
