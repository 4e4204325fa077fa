"""The router's text is a function of the token ids alone (issue 11), with vLLM's detokenization rules.

Sans-IO: journals fed upstream chunks cut anywhere, restored from checkpoints anywhere, on production-shaped
vocabularies (byte-level BPE with merges; SentencePiece-style with ``▁`` and byte fallback), against one
uninterrupted detokenization of the same ids. The worker-side alternative (a detokenizer primed with the
resumed prompt, as a worker that resumes a generation has) is shown to differ, so these tests can fail.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fleetward.fleet.vocab import Vocabulary, load_vocabulary
from fleetward.migration.journal import Journal, Kind
from fleetward.migration.text import TextSources

TEXTS = ["日本語のテキスト", "Привет, мир!", " héllo wörld ", "👩🏽‍🔬🚀✨", "ऑपरेशन", "a b  c", "🏳️‍🌈 x", "한국어",
         "ok.\n", "<s>", "</s>", "a<unk>b", "<</s>s>"]
text_st = st.lists(st.sampled_from(TEXTS) | st.text(min_size=1, max_size=8), min_size=1, max_size=6).map("".join)


def vocab(kind: str) -> Vocabulary:
    return load_vocabulary(kind)


def journal(v: Vocabulary, prompt: list[int], **body: object) -> Journal:
    j = Journal(id="cmpl-t", kind=Kind.COMPLETION, body={"model": "m", "prompt": prompt, "stream": True, **body})
    j.vocab = v
    return j


def feed(j: Journal, ids: list[int], cuts: list[int], *, finish: str | None = "length") -> str:
    """Feed ``ids`` in chunks cut at ``cuts`` (worker text deliberately wrong); the client's text."""
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    out = []
    for a, b in itertools.pairwise(bounds):
        last = b == len(ids)
        _, text, _ = j.record(ids[a:b], "<worker text ignored>", finish if last else None, None)
        out.append(text)
    return "".join(out)


@pytest.mark.parametrize("kind", ["bpe", "sp", "byte"])
@settings(max_examples=60, deadline=None)
@given(prompt=text_st, answer=text_st, cuts=st.lists(st.integers(0, 200), max_size=6), resume=st.integers(0, 200))
def test_the_client_text_is_the_uninterrupted_text_whatever_the_chunks_and_restores(
        kind: str, prompt: str, answer: str, cuts: list[int], resume: int) -> None:
    v = vocab(kind)
    p, ids = v.encode(prompt), v.encode(answer)
    reference = v.detokenizer(p).feed(ids)
    k = resume % (len(ids) + 1)
    j = journal(v, p)
    head = feed(j, ids[:k], cuts, finish=None)
    # A router restart: another replica restores the checkpoint and goes on.
    restored = Journal.from_checkpoint(j.checkpoint("r1"))
    restored.vocab = v
    tail = feed(restored, ids[k:], cuts)
    assert head + tail == reference
    assert restored.text == reference
    assert restored.text_after(k) == tail


@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_a_worker_that_resumes_renders_the_boundary_differently_and_the_router_does_not(kind: str) -> None:
    """What the router fixes: re-priming at the resumed prompt changes the text after the boundary."""
    v = vocab(kind)
    prompt = v.encode("Say it:")
    ids = v.encode(" 日本語 👩🏽‍🔬 Привет мир, héllo 🏳️‍🌈 한국어 ok")
    reference = v.detokenizer(prompt).feed(ids)
    differs = []
    for k in range(1, len(ids)):
        worker = v.detokenizer(prompt).feed(ids[:k]) + v.detokenizer(prompt + ids[:k]).feed(ids[k:])
        if worker != reference:
            differs.append(k)
        j = journal(v, prompt)
        j.record(ids[:k], "", None, None)
        j.record(ids[k:], "", "length", None)
        assert j.text == reference, k
    assert differs, "the worker-side text never differed: this vocabulary does not exercise the boundary"


def test_stop_strings_follow_vllm_rules_on_router_text() -> None:
    v = vocab("bpe")
    prompt = v.encode("Q:")
    ids = v.encode(" 日本語 stop here ✨ and more")
    full = v.detokenizer(prompt).feed(ids)
    j = journal(v, prompt, stop=["here"])
    text = feed(j, ids, [3, 5])
    assert text == full[: full.index("here")] and j.finish_reason == "stop" and j.stop_reason == "here"
    # The token that completed the stop string is the last one kept (vLLM drops the rest of the chunk).
    kept = j.emitted
    assert "here" in v.detokenizer(prompt).feed(kept) and "here" not in v.detokenizer(prompt).feed(kept[:-1])
    # include_stop_str_in_output keeps it; min_tokens delays the search past the first tokens.
    j = journal(v, prompt, stop=["here"], include_stop_str_in_output=True)
    assert feed(j, ids, []) == full[: full.index("here") + 4]
    j = journal(v, prompt, stop=["日"], min_tokens=len(ids))
    assert feed(j, ids, [], finish="length") == full and j.finish_reason == "length"


def test_the_text_of_a_token_that_ends_the_generation_is_not_output() -> None:
    v = vocab("sp")
    prompt = v.encode("Q:")
    ids = v.encode(" done")
    stop_id = v.encode(" x")[-1]
    j = journal(v, prompt)
    _, text, finish = j.record([*ids, stop_id], "", "stop", None)  # a stop_token_ids id ended it
    assert finish == "stop" and text == v.detokenizer(prompt).feed(ids)
    j = journal(v, prompt, include_stop_str_in_output=True)
    _, text, _ = j.record([*ids, stop_id], "", "stop", None)
    assert text == v.detokenizer(prompt).feed([*ids, stop_id])


def test_special_tokens_are_skipped_or_kept_as_asked() -> None:
    v = vocab("bpe")
    user, assistant = v.id_of("<|user|>"), v.id_of("<|assistant|>")
    assert user is not None and assistant is not None
    prompt = v.encode("Q:")
    ids = [*v.encode(" a"), user, assistant, *v.encode(" b")]
    j = journal(v, prompt)
    assert feed(j, ids, []) == " a b"
    j = journal(v, prompt, skip_special_tokens=False)
    assert feed(j, ids, []) == " a<|user|><|assistant|> b"
    j = journal(v, prompt, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert feed(j, ids, [2]) == v.detokenizer(prompt, skip_special_tokens=False,
                                              spaces_between_special_tokens=False).feed(ids)


@given(text=text_st)
@settings(max_examples=40, deadline=None)
def test_the_byte_vocabulary_still_agrees_with_the_sim_tokenizer(text: str) -> None:
    from fleetward.sim.tokenizer import decode, encode

    v = vocab("byte")
    assert v.encode(text) == encode(text)
    assume(text)
    assert v.decode(encode(text)) == decode(encode(text))


def test_logprob_offsets_count_from_the_requests_first_token_across_attempts() -> None:
    j = journal(vocab("byte"), [70])
    first = j.logprobs_offsets({"tokens": ["ab", "c"], "token_logprobs": [-1, -2], "text_offset": [0, 2]})
    resumed = j.logprobs_offsets({"tokens": ["d", "ef"], "token_logprobs": [-1, -2], "text_offset": [0, 1]})
    assert first["text_offset"] == [0, 2] and resumed["text_offset"] == [3, 4]
    assert Journal.from_checkpoint(j.checkpoint("r")).logprob_chars == 6


async def test_the_router_says_where_its_text_comes_from_and_tries_another_workers_word(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    texts = TextSources({"pinned": "sp"})
    try:
        texts.want("m", str(tmp_path / "nowhere"))  # a folder this host does not have
        assert await texts.get("m") is None
        assert texts.status("m")["detokenizer"] == "worker" and "nowhere" in texts.status("m")["why"]
        assert "the workers' own text is passed on" in caplog.text
        texts.want("m", "bpe")  # another worker's word, tried because the first could not be loaded
        assert texts.status("m") == {"detokenizer": "loading", "tokenizer": "bpe"}
        assert (await texts.get("m")) is load_vocabulary("bpe")
        assert texts.status("m") == {"detokenizer": "router", "tokenizer": "bpe"}
        texts.want("m", "byte")  # loaded: a third word changes nothing
        assert (await texts.get("m")) is load_vocabulary("bpe")
        texts.want("pinned", "bpe")  # routing.tokenizers wins over what workers advertise
        assert (await texts.get("pinned")) is load_vocabulary("sp")
        assert texts.status("silent")["why"] == "no worker seen yet"
    finally:
        await texts.aclose()
