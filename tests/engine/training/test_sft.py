"""SFT on CPU: the loss equals HF transformers' on the same weights, it decreases on real
data, and a run interrupted after a checkpoint resumes to the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from config.sft import SFTConfig
from config.training import OptimConfig
from conversion.registry import hf_to_megatron
from conversion.spec import GPTSpec
from data.chat import encode_chat
from data.tokenizer_train import train_chat_tokenizer
from engine.batching.collate import collate_tokens
from engine.models.megatron import build_gpt_model, load_mcore_state
from engine.storage.model_dir import load_model_dir, load_tokenizer, save_model_dir
from engine.training.sft import encode_sft_dataset, sft_loss, train_sft


def qwen2_config(vocab_size: int, hidden: int = 64) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }


def alpaca_messages(fixtures_dir: Path, n: int) -> list[dict]:
    """The first n LLaMA-Factory alpaca demo rows as user/assistant conversations."""
    rows = json.loads((fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json").read_text())[:n]
    return [
        {
            "messages": [
                {"role": "user", "content": (r["instruction"] + "\n\n" + r["input"]).strip()},
                {"role": "assistant", "content": r["output"]},
            ]
        }
        for r in rows
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory, fixtures_dir):
    """A base model dir (random tiny Qwen2, a 400-token chat BPE trained on the same rows)
    and a 32-row SFT dataset."""
    root = tmp_path_factory.mktemp("sft")
    rows = alpaca_messages(fixtures_dir, 32)
    texts = [m["content"] for r in rows for m in r["messages"]]
    tok_dir = train_chat_tokenizer(texts, root / "tokenizer", vocab_size=400)
    cfg = qwen2_config(len(load_tokenizer_dir(tok_dir)))
    model = build_gpt_model(GPTSpec.from_hf_config(cfg), seed=0, core_attention="sdpa")
    save_model_dir(root / "base", model, cfg, tok_dir)
    return root / "base", write_jsonl(root / "sft.jsonl", rows), root


def load_tokenizer_dir(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def mean_loss(model_dir: Path, dataset: Path, max_len: int) -> float:
    loaded = load_model_dir(model_dir)
    examples = encode_sft_dataset(dataset, load_tokenizer(model_dir), max_len)
    batch = collate_tokens([e[0] for e in examples], [e[1] for e in examples])
    with torch.no_grad():
        total, units, _ = sft_loss(loaded.model, batch)
    return float(total) / units


def test_sft_loss_equals_hf_transformers(tmp_path, fixtures_dir):
    """Megatron model + our masked loss vs HF Qwen2 + an independent masked CE, same weights,
    real Qwen2.5 tokenizer and chat template."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok_dir = fixtures_dir / "qwen2.5-tokenizer"
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = qwen2_config(len(tok), hidden=32)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**cfg)).eval()
    mcore = build_gpt_model(GPTSpec.from_hf_config(cfg), seed=1, core_attention="sdpa")
    load_mcore_state(mcore, hf_to_megatron(cfg, hf.state_dict()))
    save_model_dir(tmp_path / "m", mcore, cfg, tok_dir)
    model = load_model_dir(tmp_path / "m").model

    encoded = [encode_chat(tok, r["messages"], max_len=96) for r in alpaca_messages(fixtures_dir, 4)]
    batch = collate_tokens([e.input_ids for e in encoded], [e.loss_mask for e in encoded], tok.pad_token_id)
    assert batch.input_ids.size(1) == 96 and int(batch.lengths.min()) < 96  # truncated and padded rows

    loss_sum, n_tokens, _ = sft_loss(model, batch)
    ours = loss_sum / n_tokens
    ours.backward()

    logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    ce = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), batch.input_ids[:, 1:].reshape(-1), reduction="none"
    )
    mask = batch.loss_mask[:, 1:].reshape(-1).float()
    ref = (ce * mask).sum() / mask.sum()
    ref.backward()

    assert n_tokens == int(mask.sum()) == sum(sum(e.loss_mask[1:]) for e in encoded)
    assert abs(float(ours) - float(ref)) < 1e-5
    assert torch.allclose(
        dict(model.named_parameters())["decoder.final_layernorm.weight"].grad, hf.model.norm.weight.grad, atol=1e-5
    )


def test_sft_loss_decreases_on_real_data(base):
    base_dir, dataset, root = base
    cfg = SFTConfig(
        precision="fp32",
        steps=24,
        global_batch_size=8,
        micro_batch_size=4,
        max_seq_len=128,
        optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=4),
        checkpoint_every=10,
        log_every=1,
    )
    logged: list[tuple[int, dict]] = []
    final = train_sft(
        base_dir,
        dataset,
        cfg,
        root / "sft_out",
        root / "sft_resume",
        seed=0,
        log_metrics=lambda m, s: logged.append((s, m)),
    )

    assert [s for s, _ in logged] == list(range(1, 25))
    # From ln(400) = 6.0 nats (uniform) to below the ~5 nats of the token unigram distribution.
    losses = [m["train/loss"] for _, m in logged]
    assert abs(losses[0] - 6.0) < 0.05 and losses[-1] < losses[0] - 0.8, losses
    # 24 steps x 8 rows = exactly 6 epochs over the 32 rows.
    examples = encode_sft_dataset(dataset, load_tokenizer(base_dir), 128)
    assert final["train/epoch"] == 6.0
    assert final["train/tokens"] == 6 * sum(sum(e[1][1:]) for e in examples)
    assert final["train/loss"] == losses[-1] and final["train/lr"] == logged[-1][1]["train/lr"]
    assert final["perf/tokens_per_s"] > 0 and final["train/grad_norm"] > 0
    # The written model dir holds the trained weights: lower loss on the data than the base.
    before, after = mean_loss(base_dir, dataset, 128), mean_loss(root / "sft_out", dataset, 128)
    assert after < before - 0.8, (before, after)
    assert (root / "sft_out" / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "24"


class Crash(RuntimeError):
    pass


def test_sft_resumes_after_a_crash_to_identical_weights(base):
    base_dir, dataset, root = base
    cfg = SFTConfig(
        precision="fp32",
        steps=4,
        global_batch_size=12,
        micro_batch_size=4,
        max_seq_len=64,
        optim=OptimConfig(lr=2e-3, warmup_steps=1, weight_decay=0.01),
        checkpoint_every=2,
        log_every=1,
    )
    train_sft(base_dir, dataset, cfg, root / "straight", root / "resume_a", seed=3)

    def crash_at_3(metrics, step):
        if step == 3:  # done (and across an epoch end) but not checkpointed: resume redoes it
            raise Crash()

    with pytest.raises(Crash):
        train_sft(base_dir, dataset, cfg, root / "resumed", root / "resume_b", seed=3, log_metrics=crash_at_3)
    assert not (root / "resumed").exists()
    steps_seen: list[int] = []
    train_sft(
        base_dir,
        dataset,
        cfg,
        root / "resumed",
        root / "resume_b",
        seed=3,
        log_metrics=lambda m, s: steps_seen.append(s),
    )
    assert steps_seen == [3, 4]

    a = load_model_dir(root / "straight").model.state_dict()
    b = load_model_dir(root / "resumed").model.state_dict()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k

    # A finished state only re-publishes the model dir: no step runs, same weights.
    again_steps: list[int] = []
    again = train_sft(
        base_dir,
        dataset,
        cfg,
        root / "again",
        root / "resume_b",
        seed=3,
        log_metrics=lambda m, s: again_steps.append(s),
    )
    n_rows = len(encode_sft_dataset(dataset, load_tokenizer(base_dir), 64))  # rows with a target in 64 tokens
    assert again_steps == [] and again["train/steps"] == 4.0 and again["train/epoch"] == 4 * 12 / n_rows
    c = load_model_dir(root / "again").model.state_dict()
    assert all(torch.equal(v, c[k]) for k, v in a.items() if isinstance(v, torch.Tensor))

    other = cfg.model_copy(update={"steps": 5})
    with pytest.raises(ValueError, match="different run"):
        train_sft(base_dir, dataset, other, root / "x", root / "resume_b", seed=3)


def test_bad_row_names_file_and_line(base, tmp_path):
    base_dir, _, _ = base
    bad = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": "not a list"},
        ],
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: messages"):
        encode_sft_dataset(bad, load_tokenizer(base_dir), 64)
    no_answer = write_jsonl(tmp_path / "user_only.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"user_only.jsonl:1: messages: no assistant turn"):
        encode_sft_dataset(no_answer, load_tokenizer(base_dir), 64)


def test_template_errors_name_the_row(fixtures_dir, tmp_path):
    """Gemma's template raises on a system turn: the SFT data error names file, line and the
    template's own message; a tokenizer without a chat template fails before any row."""
    from transformers import AutoTokenizer

    from tests.data.chat_tokenizers import paired_tokenizer

    gemma = paired_tokenizer(fixtures_dir, "gemma", fixtures_dir / "qwen2.5-tokenizer")
    rows = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            },
        ],
    )
    with pytest.raises(
        ValueError,
        match=r"chat.jsonl:2: messages: the chat template of .* cannot render this "
        r"conversation \(roles: system, user, assistant\): System role not supported",
    ):
        encode_sft_dataset(rows, gemma, 64)
    first = write_jsonl(tmp_path / "one.jsonl", [json.loads(rows.read_text().splitlines()[0])])
    [(ids, mask)] = encode_sft_dataset(first, gemma, 64)
    assert gemma.decode([t for t, m in zip(ids, mask) if m]) == "hello<end_of_turn>"
    plain = AutoTokenizer.from_pretrained(fixtures_dir / "qwen2.5-tokenizer")
    plain.chat_template = None
    with pytest.raises(ValueError, match=r"qwen2.5-tokenizer: the tokenizer has no chat template.*sft.enabled: false"):
        encode_sft_dataset(rows, plain, 64)


def test_tool_call_rows_train_on_the_calls(fixtures_dir, tmp_path):
    """A normalized SFT record with ``tools`` and an assistant tool-call turn (transformers'
    convention): the calls and turn ends are trained, the tool result is not."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixtures_dir / "qwen2.5-tokenizer")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    record = {
        "messages": [
            {"role": "user", "content": "What is 2+3?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
            },
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "2+3 is 5."},
        ],
        "tools": tools,
    }
    [(ids, mask)] = encode_sft_dataset(write_jsonl(tmp_path / "tools.jsonl", [record]), tok, 512)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>2+3 is 5.<|im_end|>'
    )
    assert "# Tools" in tok.decode(ids)
    assert "<tool_response>\n5\n</tool_response>" in tok.decode([t for t, m in zip(ids, mask) if not m])
    with pytest.raises(ValueError, match=r"bad_tools.jsonl:1: tools: expected a list of JSON-schema objects"):
        encode_sft_dataset(write_jsonl(tmp_path / "bad_tools.jsonl", [{**record, "tools": "add"}]), tok, 512)
