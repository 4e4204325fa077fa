"""The tiny local model: deterministic files, a tokenizer that agrees with fleetward's byte tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fleetward.cli import main
from fleetward.sim.tokenizer import CHAT_TEMPLATE, decode, encode, render_chat

pytest.importorskip("torch")
pytest.importorskip("safetensors")


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_seed_writes_identical_files_and_another_seed_other_weights(tmp_path: Path) -> None:
    assert main(["model", "tiny", "--out", str(tmp_path / "a"), "--seed", "3"]) == 0
    assert main(["model", "tiny", "--out", str(tmp_path / "b"), "--seed", "3"]) == 0
    assert main(["model", "tiny", "--out", str(tmp_path / "c"), "--seed", "4"]) == 0
    a, b, c = (digest(tmp_path / x) for x in "abc")
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= set(a)


def test_the_model_tokenizer_encodes_like_the_byte_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    main(["model", "tiny", "--out", str(tmp_path)])
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in ["Hello, world!", "héllo ✓ 日本", "<|user|>hi\n<|assistant|>", " leading space", ""]:
        ids = tok.encode(text).ids
        assert ids == encode(text), text
        assert decode(ids) == text


def test_the_jinja_chat_template_renders_like_render_chat() -> None:
    jinja2 = pytest.importorskip("jinja2")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    rendered = jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert rendered == render_chat(messages)
