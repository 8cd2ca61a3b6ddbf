"""A tiny trained-looking policy published as real artifacts, for the chat, serve and push tests.

The quickstart's kind of tokenizer (byte-level BPE with its chat template, trained on addition
chats) and a random 2-layer Qwen2 (hidden 64, head_dim 32: vLLM on CPU needs head_dim >= 32)
built as megatron-core and saved with the product's own functions: an ``rl`` artifact holding
``model/`` (Megatron torch_dist + ``hf/``) and an ``export`` artifact holding ``hf_model/``
(:func:`engine.storage.hf_io.export_model_dir`, as the export stage writes it), both published
with :class:`tasks.artifacts.ArtifactStore` under ``<root>/artifacts``. No pipeline runs.
"""

from __future__ import annotations

import json
from pathlib import Path

FINGERPRINTS = {"rl": "1" * 64, "export": "2" * 64}


def tiny_chat(root: Path) -> dict:
    """Build and publish; returns ``{"store", "rl", "export"}``: the store root and, per stage,
    ``{"id", "dir"}`` (the published artifact directory); plus ``"tokenizer"``."""
    import torch
    from transformers import AutoTokenizer

    from conversion.spec import GPTSpec
    from data.addition import make_addition_datasets
    from data.tokenizer_train import train_chat_tokenizer
    from engine.models.megatron import build_gpt_model
    from engine.storage.hf_io import export_model_dir
    from engine.storage.model_dir import save_model_dir
    from tasks.artifacts import ArtifactStore

    paths = make_addition_datasets(root / "data", num_sft=300, num_preference=4, num_rl=4, num_eval=4, seed=1)
    sft = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    texts = ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in r["messages"]) for r in sft]
    tok_dir = train_chat_tokenizer(texts, root / "tokenizer", vocab_size=300)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    hf_config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": len(tok),
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 128,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    model = build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=3).eval()
    with torch.no_grad():  # sharper logits: greedy choices far from ties, in every engine
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    store = ArtifactStore(str(root / "artifacts"))
    rl_work = root / "work-rl"
    save_model_dir(rl_work / "model", model, hf_config, tok_dir)
    rl = store.publish("rl", FINGERPRINTS["rl"], rl_work, {"inputs": {}, "metrics": {}})
    export_work = root / "work-export"
    export_model_dir(Path(rl.uri) / "model", export_work / "hf_model", dtype="float32")
    export = store.publish(
        "export", FINGERPRINTS["export"], export_work, {"inputs": {"rl": rl.model_dump()}, "metrics": {}}
    )
    return {
        "store": root / "artifacts",
        "tokenizer": tok_dir,
        "rl": {"id": rl.artifact_id, "dir": Path(rl.uri)},
        "export": {"id": export.artifact_id, "dir": Path(export.uri)},
    }
