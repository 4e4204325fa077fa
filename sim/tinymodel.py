"""``fleetward model tiny``: a tiny Llama that real vLLM serves on a CPU, written locally.

Shape (verified on vLLM 0.32 CPU, see shared notes): hidden 128, 2 heads of 64 (the CPU attention kernel
rejects head_dim 16), 1 KV head, 2 layers, intermediate 256, byte-level vocabulary of 259 ids. Weights are
drawn from a seeded normal with std 1.0: the default 0.02 makes greedy output collapse into runs of one
token, and a lost or duplicated token inside such a run is invisible to an exactness check.

The output is deterministic for a given seed (same bytes on every machine with the same torch).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from fleetward.fleet.errors import FleetwardError
from fleetward.sim.tokenizer import BOS_ID, BYTE_OFFSET, CHAT_TEMPLATE, EOS_ID, UNK_ID, VOCAB_SIZE

__all__ = ["TINY_SHAPE", "ensure_tiny_model", "write_tiny_model"]

TINY_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel tokenizers use as vocab keys)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _tokenizer_json() -> dict[str, object]:
    b2u = _bytes_to_unicode()
    vocab = {"<unk>": UNK_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({b2u[b]: BYTE_OFFSET + b for b in range(256)})
    special = [
        {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for c, i in (("<unk>", UNK_ID), ("<s>", BOS_ID), ("</s>", EOS_ID))
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def ensure_tiny_model(path: Path, *, say: Callable[[str], None] | None = None) -> Path:
    """The tiny model at ``path``, written first (seed 0) unless it is there already."""
    if not (path / "model.safetensors").exists():
        if say is not None:
            say(f"writing the tiny local model to {path}")
        write_tiny_model(path)
    return path


def write_tiny_model(out: Path, *, seed: int = 0, max_position_embeddings: int = 2048, std: float = 1.0) -> Path:
    """Write config, tokenizer and seeded safetensors weights into ``out``; returns ``out``."""
    try:
        import torch
        from safetensors.torch import save_file
    except ImportError as exc:
        raise FleetwardError(f"`fleetward model tiny` needs torch and safetensors ({exc.name} is missing): "
                             "pip install 'fleetward[model]'") from exc
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY_SHAPE
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "initializer_range": std,
        "attention_bias": False,
        "mlp_bias": False,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(_tokenizer_json(), ensure_ascii=False) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2) + "\n")

    h, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, dtype=torch.float32) * std)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, h)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(heads * hd, h)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv * hd, h)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv * hd, h)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, heads * hd)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, h)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, inter)
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.float32)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float32)
    tensors["model.norm.weight"] = torch.ones(h, dtype=torch.float32)
    tensors["lm_head.weight"] = normal(VOCAB_SIZE, h)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})  # one key: Rust orders a map randomly
    return out
