"""The export stage's output is a model users can load: transformers and vLLM (started from
the exported directory, as a user would) both decode it greedily to exactly the tokens the
engine's own megatron-core policy produces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conversion.spec import GPTSpec
from data.addition import make_addition_datasets
from data.tokenizer_train import train_chat_tokenizer
from engine.models.megatron import build_gpt_model, gpt_logits
from engine.storage.hf_io import export_model_dir
from engine.storage.model_dir import save_model_dir

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

MAX_NEW = 8
QUESTIONS = ["What is 47 + 38?", "What is 5 + 7?", "What is 90 + 19?", "What is 33 + 66?"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A Megatron policy (Qwen2 layout, head_dim 32 so vLLM can serve it, untied output
    layer) on the quickstart's tokenizer, saved as a model directory and exported as the
    export stage does. Returns (megatron model, tokenizer, prompt ids, exported dir)."""
    root = tmp_path_factory.mktemp("export")
    paths = make_addition_datasets(root / "data", num_sft=300, num_preference=10, num_rl=10, num_eval=10, seed=1)
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
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    model = build_gpt_model(GPTSpec.from_hf_config(hf_config), seed=3).eval()
    with torch.no_grad():  # sharper logits: greedy choices far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
        # Make EOS the greedy choice wherever token 3 of the first prompt's free decoding
        # would be, so some responses stop early and stopping is compared too.
        texts = [
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS
        ]
        prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
        free = megatron_greedy(model, prompts[0], 3, eos=-1)
        head = model.output_layer.weight
        head[tok.eos_token_id] = 1.05 * head[free[-1]]
    model_dir = save_model_dir(root / "policy", model, hf_config, tok_dir)
    out = export_model_dir(model_dir, root / "hf_model")
    return model, tok, prompts, out


def megatron_greedy(model, prompt: list[int], max_new: int, eos: int) -> list[int]:
    """Greedy decoding with full megatron-core forward passes (no KV cache); EOS included."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(gpt_logits(model, torch.tensor([ids]))[0, -1].argmax()))
            if ids[-1] == eos:
                break
    return ids[len(prompt) :]


def test_export_decodes_like_the_policy_in_transformers(exported):
    model, tok, prompts, out = exported
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert AutoTokenizer.from_pretrained(out)("What is 47 + 38?").input_ids == tok("What is 47 + 38?").input_ids
    expected = [megatron_greedy(model, p, MAX_NEW, tok.eos_token_id) for p in prompts]
    assert any(e[-1] == tok.eos_token_id for e in expected) and any(len(e) > 3 for e in expected), expected
    for prompt, want in zip(prompts, expected):
        ids = torch.tensor([prompt])
        got = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        assert got[0, len(prompt) :].tolist() == want


VLLM_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    path, prompts, max_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=2**26,
              enable_chunked_prefill=False, max_num_batched_tokens=8192)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_new))
    print("TOKENS=" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
""")


def test_export_decodes_like_the_policy_in_vllm(exported):
    """vLLM reads the directory itself (weights, config, tokenizer, generation config: EOS
    comes from there), in a process of its own as a serving user would run it."""
    model, tok, prompts, out = exported
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(out), json.dumps(prompts), str(MAX_NEW)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS=")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    got = json.loads(lines[-1].removeprefix("TOKENS="))
    assert got == [megatron_greedy(model, p, MAX_NEW, tok.eos_token_id) for p in prompts]
