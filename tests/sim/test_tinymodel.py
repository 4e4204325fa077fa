"""The tiny local model: deterministic files, the built-in vocabularies the simulated worker serves."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fleetward.cli import main
from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.vocab import CHAT_ROLES, load_vocabulary
from fleetward.sim.tinymodel import ensure_tiny_model
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


def test_the_byte_model_tokenizer_encodes_like_the_byte_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    main(["model", "tiny", "--out", str(tmp_path), "--tokenizer", "byte"])
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 259
    for text in ["Hello, world!", "héllo ✓ 日本", "<|user|>hi\n<|assistant|>", " leading space", ""]:
        ids = tok.encode(text).ids
        assert ids == encode(text), text
        assert decode(ids) == text


def test_the_jinja_chat_template_renders_like_render_chat() -> None:
    jinja2 = pytest.importorskip("jinja2")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    rendered = jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert rendered == render_chat(messages)


@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_a_trained_vocabulary_is_what_the_simulated_worker_serves_and_merges_and_splits(tmp_path: Path,
                                                                                     kind: str) -> None:
    main(["model", "tiny", "--out", str(tmp_path), "--tokenizer", kind])
    folder, builtin = load_vocabulary(tmp_path), load_vocabulary(kind)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == folder.size == builtin.size == 4096
    assert config["eos_token_id"] == folder.id_of("</s>")
    text = "The quick brown fox — naïve café, Привет мир, 日本語のテキスト, 😀👩🏽‍🔬 done"
    ids = folder.encode(text, add_special_tokens=False)
    assert ids == builtin.encode(text, add_special_tokens=False)
    assert folder.decode(ids) == text
    assert len(ids) < 0.75 * len(text.encode()), "merges: fewer tokens than bytes"
    # A character spread over several tokens: some token's text alone is not valid text.
    assert any("\ufffd" in folder.decode([i]) for i in ids)
    rendered = render_chat([{"role": "user", "content": "hi"}])
    chat_ids = folder.encode(rendered, add_special_tokens=False)
    assert folder.id_of("<|user|>") in chat_ids and folder.id_of("<|assistant|>") == chat_ids[-1]
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["additional_special_tokens"] == list(CHAT_ROLES)
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE


def test_ensure_tiny_model_writes_once_and_refuses_a_folder_with_another_vocabulary(tmp_path: Path) -> None:
    said: list[str] = []
    path = ensure_tiny_model(tmp_path / "m", tokenizer="byte", say=said.append)
    assert len(said) == 1 and "byte" in said[0]
    before = digest(path)
    assert ensure_tiny_model(path, tokenizer="byte", say=said.append) == path
    assert len(said) == 1 and digest(path) == before
    with pytest.raises(FleetwardError, match="not the built-in 'bpe'"):
        ensure_tiny_model(path, tokenizer="bpe")
