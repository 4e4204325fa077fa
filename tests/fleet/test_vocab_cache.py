"""The trained vocabularies are trained once per machine, not once per process (fleet/vocab.py, ``_cache_file``):
the next process reads what the first left in the cache folder, and a cache that is broken or cannot be
written costs only the training."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetward.fleet import vocab


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    vocab._builtin_text.cache_clear()  # as a new process
    yield tmp_path / "cache" / "fleetward"
    vocab._builtin_text.cache_clear()  # the other tests' processes read their own cache again


def test_the_first_process_trains_and_the_next_reads_what_it_left(cache: Path) -> None:
    trained = vocab.builtin_json("sp")
    (kept,) = cache.glob("vocab-sp-*.json")
    assert json.loads(kept.read_text(encoding="utf-8")) == trained
    assert not [p for p in cache.iterdir() if p.name.startswith(".")], "no partial file is left"
    marked = {**trained, "version": "read from the cache"}
    kept.write_text(json.dumps(marked), encoding="utf-8")
    vocab._builtin_text.cache_clear()  # the next process
    assert vocab.builtin_json("sp") == marked


def test_a_broken_cache_file_is_trained_again_and_an_unwritable_cache_only_trains(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = vocab._train("sp")
    cache.mkdir(parents=True)
    broken = vocab._cache_file("sp")
    broken.write_text('{"model": {"vocab"', encoding="utf-8")  # cut short
    assert vocab.builtin_json("sp") == expected
    assert json.loads(broken.read_text(encoding="utf-8")) == expected, "written again, whole"
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    vocab._builtin_text.cache_clear()
    assert vocab.builtin_json("sp") == expected
