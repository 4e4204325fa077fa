"""``fleetward model tiny``: a tiny Llama that real vLLM serves on a CPU, written locally.

Shape (verified on vLLM 0.32 CPU): hidden 128, 2 heads of 64 (the CPU attention kernel rejects head_dim
16), 1 KV head, 2 layers, intermediate 256. Weights are drawn from a seeded normal with std 1.0: the
default 0.02 makes greedy output collapse into runs of one token, and a lost or duplicated token inside
such a run is invisible to an exactness check.

The vocabulary is one of :data:`fleetward.fleet.vocab.BUILTIN`: ``bpe`` (the default: a byte-level BPE of
4,096 ids, where one character may span several tokens), ``sp`` (SentencePiece-shaped: a ``▁`` space
marker and byte fallback) or ``byte`` (259 ids, one per byte). Its ``tokenizer.json`` is the one the
simulated worker serves with the same name, so both agree on ids and text.

The output is deterministic for a given seed and vocabulary (same bytes on every machine with the same
torch and tokenizers).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.vocab import BUILTIN, builtin_json
from fleetward.sim.tokenizer import BOS_ID, CHAT_TEMPLATE, EOS_ID

__all__ = ["TINY_SHAPE", "ensure_tiny_model", "write_tiny_model"]

TINY_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
}


def ensure_tiny_model(path: Path, *, tokenizer: str = "bpe", say: Callable[[str], None] | None = None) -> Path:
    """The tiny model at ``path``, written first (seed 0) unless it is there already.

    A folder that holds a model with another vocabulary is refused, not served: its ids would not be the
    ones the rest of the fleet expects.
    """
    if not (path / "model.safetensors").exists():
        if say is not None:
            say(f"writing the tiny local model ({tokenizer} vocabulary) to {path}")
        write_tiny_model(path, tokenizer=tokenizer)
        return path
    try:
        found = json.loads((path / "tokenizer.json").read_text())
    except (OSError, ValueError):
        found = None
    if found != builtin_json(tokenizer):
        raise FleetwardError(f"{path} holds a model whose tokenizer is not the built-in {tokenizer!r} vocabulary; "
                             f"remove the folder or write another with `fleetward model tiny --tokenizer "
                             f"{tokenizer} --out DIR`")
    return path


def write_tiny_model(out: Path, *, seed: int = 0, tokenizer: str = "bpe", max_position_embeddings: int = 2048,
                     std: float = 1.0) -> Path:
    """Write config, tokenizer and seeded safetensors weights into ``out``; returns ``out``."""
    if tokenizer not in BUILTIN:
        raise FleetwardError(f"no built-in vocabulary {tokenizer!r}; choose one of {', '.join(BUILTIN)}")
    try:
        import torch
        from safetensors.torch import save_file
    except ImportError as exc:
        raise FleetwardError(f"`fleetward model tiny` needs torch and safetensors ({exc.name} is missing): "
                             "pip install 'fleetward[model]'") from exc
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY_SHAPE
    tok = builtin_json(tokenizer)
    vocab_size = 1 + max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])])
    added = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
             for t in tok["added_tokens"]}
    extra = [t["content"] for t in tok["added_tokens"] if t["content"] not in ("<unk>", "<s>", "</s>")]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "vocab_size": vocab_size,
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
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "additional_special_tokens": extra,
        "added_tokens_decoder": added,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "additional_special_tokens": extra},
        indent=2) + "\n")

    h, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, dtype=torch.float32) * std)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, h)}
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
    tensors["lm_head.weight"] = normal(vocab_size, h)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})  # one key: Rust orders a map randomly
    return out
