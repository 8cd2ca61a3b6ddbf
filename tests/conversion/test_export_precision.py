"""Export in the configured dtype (``export.dtype``: bfloat16 under bf16, float32 under fp32):
the SafeTensors hold that dtype, ``config.json`` says so, transformers loads it in that dtype,
and its greedy decoding equals the project's HF rollout engine run on the same weights at
that dtype. (vLLM loading the bfloat16 export: tests/engine/rollout/test_vllm_bf16.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conversion.registry import megatron_to_hf
from conversion.spec import GPTSpec
from engine.models.megatron import build_gpt_model, gpt_logits, mcore_state
from engine.rollout.base import SamplingSpec
from engine.rollout.factory import build_rollout_engine
from engine.storage.hf_io import export_model_dir
from engine.storage.model_dir import save_model_dir

MAX_NEW = 8
QUESTIONS = ["What is 4 + 3?", "What is 2 + 1?", "What is 0 + 4?"]


def tiny_policy(root: Path, seed: int = 3, eos_from: int | None = 0):
    """A megatron-core Qwen2 policy (hidden 64, 2 layers, 2 heads of head_dim 32, one KV head:
    vLLM on CPU can serve it; untied output layer) on a small chat tokenizer, with 2-D weights
    scaled by 8 so next-token logits are far apart (greedy choices are not near-ties, in
    bfloat16 too). With ``eos_from`` set, EOS is made the greedy choice wherever the 3rd token
    of that prompt's free decoding would be, so some responses stop early.

    Returns ``(model, tokenizer, prompt ids, hf_config, tokenizer dir)``; the caller saves it.
    """
    from transformers import AutoTokenizer

    from data.tokenizer_train import train_chat_tokenizer

    texts = [
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n"
        for a in range(5)
        for b in range(5)
    ]
    tok_dir = root / "tokenizer"
    if not tok_dir.is_dir():
        train_chat_tokenizer(texts, tok_dir, vocab_size=280)
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
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    model = build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=seed).eval()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    prompts = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
        if eos_from is not None:
            ids = list(prompts[eos_from])
            for _ in range(3):
                ids.append(int(gpt_logits(model, torch.tensor([ids]))[0, -1].argmax()))
            head = model.output_layer.weight
            head[tok.eos_token_id] = 1.05 * head[ids[-1]]
    return model, tok, prompts, hf_config, tok_dir


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_precision")
    model, tok, prompts, hf_config, tok_dir = tiny_policy(root)
    return save_model_dir(root / "policy", model, hf_config, tok_dir), model, tok, prompts, hf_config


def hf_generate(model, prompt: list[int], tok) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=MAX_NEW,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_export_dtype_loads_in_transformers_and_decodes_like_the_hf_rollout_engine(policy, tmp_path, precision, dtype):
    model_dir, model, tok, prompts, hf_config = policy
    name = str(dtype).removeprefix("torch.")
    out = export_model_dir(model_dir, tmp_path / "hf_model", dtype=name)

    # the files: every tensor in the dtype, the megatron weights rounded to it (round to nearest even)
    want = {k: v.to(dtype) for k, v in megatron_to_hf(hf_config, mcore_state(model))}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(want)
        for key in f.keys():
            t = f.get_tensor(key)
            assert t.dtype == dtype and torch.equal(t, want[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == name

    # transformers reads the dtype from config.json (no dtype argument)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert {p.dtype for p in hf.parameters()} == {dtype}
    expected = [hf_generate(hf, p, tok) for p in prompts]
    assert any(e[-1] == tok.eos_token_id for e in expected) and any(len(e) == MAX_NEW for e in expected), expected

    # the project's HF rollout engine at the stage's precision, exported by the factory as the RL
    # rollout worker's HF backend does (hf_export): the same dtype, the same greedy tokens
    engine = build_rollout_engine(
        "hf",
        model_dir / "hf",
        what="rl.rollout.backend",
        precision=precision,
        hf_export=(model_dir, tmp_path / "rollout_hf"),
    )
    assert engine.dtype == dtype and {p.dtype for p in engine.model.parameters()} == {dtype}
    assert json.loads((tmp_path / "rollout_hf" / "config.json").read_text())["dtype"] == name
    outs = engine.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_new_tokens=MAX_NEW))
    assert [list(o.token_ids) for (o,) in outs] == expected
    assert [o.finish_reason for (o,) in outs] == ["stop" if e[-1] == tok.eos_token_id else "length" for e in expected]
