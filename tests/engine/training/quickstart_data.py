"""A tiny stand-in of the quickstart's SFT and reward-model inputs for trainer tests.

The data is the quickstart's own (``data.addition.make_addition_datasets``: "What is 47 + 38?"
-> "85" conversations and correct-vs-wrong-sum preference pairs) with a chat BPE trained on
it as ``tasks.prepare`` does; the model is a Qwen2-architecture GPTModel far smaller than
the quickstart's (hidden 32, one layer) so that emulated bf16 stays fast on CPUs without
native bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

from conversion.spec import GPTSpec
from data.addition import make_addition_datasets
from data.tokenizer_train import train_chat_tokenizer
from engine.models.megatron import build_gpt_model
from engine.storage.model_dir import save_model_dir


def tiny_qwen2_config(vocab_size: int, hidden: int = 32, layers: int = 1) -> dict:
    """HF ``config.json`` of a Qwen2 decoder: 2 query heads of 16, 1 KV head (GQA), SwiGLU 2 x hidden."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }


def make_quickstart_inputs(root: Path, num_sft: int = 256, num_preference: int = 64, seed: int = 0) -> dict[str, Path]:
    """Write the addition SFT and preference JSONL files, a tokenizer and a random tiny base
    model directory (``core_attention="sdpa"``, so packing can run) under ``root``.

    Returns: ``{"sft": jsonl, "preference": jsonl, "base": model dir}``.
    """
    from transformers import AutoTokenizer

    files = make_addition_datasets(
        root / "data", num_sft=num_sft, num_preference=num_preference, num_rl=1, num_eval=1, seed=seed
    )
    texts: list[str] = []
    for name in ("sft", "preference"):
        for line in files[name].read_text().splitlines():
            row = json.loads(line)
            texts += [m["content"] for m in row.get("messages", row.get("prompt", []))]
            texts += [row[k] for k in ("chosen", "rejected") if k in row]
    tok_dir = train_chat_tokenizer(texts, root / "tokenizer", vocab_size=300)
    cfg = tiny_qwen2_config(len(AutoTokenizer.from_pretrained(str(tok_dir))))
    model = build_gpt_model(GPTSpec.from_hf_config(cfg), seed=seed, core_attention="sdpa")
    save_model_dir(root / "base", model, cfg, tok_dir)
    return {"sft": files["sft"], "preference": files["preference"], "base": root / "base"}
