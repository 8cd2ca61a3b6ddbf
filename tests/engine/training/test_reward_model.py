"""Reward model: the Bradley-Terry loss against hand-computed values, reward read at the last
real token, training to high held-out accuracy, and save/load/score round trip."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from config.rm import RMConfig
from config.training import OptimConfig
from conversion.spec import GPTSpec
from data.tokenizer_train import train_chat_tokenizer
from engine.backends.select_rm import reward_trainer
from engine.batching.collate import collate_tokens
from engine.models.heads import RewardModel
from engine.models.megatron import build_gpt_model, gpt_hidden_states
from engine.storage.model_dir import load_model_dir, load_tokenizer, save_model_dir
from engine.training.preference_data import encode_preference_dataset
from engine.training.reward_model import bradley_terry_loss, split_eval, train_reward_model
from engine.training.reward_scoring import load_reward_model, score

GOOD = ["great", "helpful", "correct", "clear", "kind", "precise"]
BAD = ["wrong", "rude", "useless", "vague", "lazy", "false"]


def test_bradley_terry_loss_hand_values():
    r_c = torch.tensor([1.0, 0.0, -2.0, 30.0])
    r_r = torch.tensor([0.0, 0.0, 1.0, -30.0])
    expected = [math.log(1 + math.exp(-1)), math.log(2), math.log(1 + math.exp(3)), math.log1p(math.exp(-60))]
    got = bradley_terry_loss(r_c, r_r)
    assert got.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-30)
    assert got.tolist()[:3] == pytest.approx([0.31326168751822286, 0.6931471805599453, 3.048587351573742], abs=1e-6)


def preference_rows(fixtures_dir: Path, n: int) -> list[dict]:
    """Real alpaca instructions as prompts; the chosen answer uses only approving words, the
    rejected one only disapproving words (an easy, learnable preference)."""
    rng = random.Random(0)
    instructions = [
        r["instruction"]
        for r in json.loads((fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json").read_text())[:n]
    ]
    rows = []
    for text in instructions:
        k = rng.randint(2, 5)
        rows.append(
            {
                "prompt": [{"role": "user", "content": text}],
                "chosen": " ".join(rng.choice(GOOD) for _ in range(k)),
                "rejected": " ".join(rng.choice(BAD) for _ in range(rng.randint(2, 5))),
            }
        )
    return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory, fixtures_dir):
    root = tmp_path_factory.mktemp("rm")
    rows = preference_rows(fixtures_dir, 80)
    texts = [r["prompt"][0]["content"] for r in rows] + [" ".join(GOOD + BAD)] * 4
    tok_dir = train_chat_tokenizer(texts, root / "tokenizer", vocab_size=320)
    from transformers import AutoTokenizer

    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": len(AutoTokenizer.from_pretrained(str(tok_dir))),
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }
    model = build_gpt_model(GPTSpec.from_hf_config(cfg), seed=0, core_attention="sdpa")
    save_model_dir(root / "base", model, cfg, tok_dir)
    data = root / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, data, rows


def test_reward_is_read_at_the_last_real_token(setup):
    root, _, _ = setup
    loaded = load_model_dir(root / "base")
    rm = RewardModel(loaded.model, loaded.spec.hidden_size, seed=1)
    batch = collate_tokens([[5, 6, 7, 8], [9, 10]], None, pad_id=0)
    with torch.no_grad():
        rewards = rm(batch.input_ids, batch.lengths)
        h = gpt_hidden_states(loaded.model, torch.tensor([[9, 10]]))[0, -1]
    expected = h @ rm.reward_head.weight[0] + rm.reward_head.bias[0]
    assert rewards.shape == (2,) and torch.allclose(rewards[1], expected, atol=1e-6)


def test_training_reaches_high_held_out_accuracy_and_round_trips(setup):
    root, data, rows = setup
    cfg = RMConfig(
        precision="fp32",
        steps=12,
        global_batch_size=16,
        micro_batch_size=8,
        max_seq_len=96,
        eval_fraction=0.25,
        optim=OptimConfig(lr=3e-3, warmup_steps=3),
        log_every=4,
    )
    logged: list[int] = []
    metrics = train_reward_model(
        reward_trainer, root / "base", data, cfg, root / "rm", seed=0, log_metrics=lambda m, s: logged.append(s)
    )
    assert logged == [4, 8, 12]
    assert metrics["rm/num_eval_pairs"] == 20 and metrics["rm/num_train_pairs"] == 60
    assert metrics["rm/accuracy"] >= 0.9, metrics
    assert metrics["rm/loss"] < math.log(2) - 0.2, metrics

    # Reload from disk and score the held-out pairs through the public scoring path.
    model, tok = load_reward_model(root / "rm", cfg.precision), load_tokenizer(root / "rm")
    _, held_out = split_eval(len(rows), cfg.eval_fraction, seed=0)
    prompts = [rows[i]["prompt"] for i in held_out]
    r_c = score(model, tok, prompts, [rows[i]["chosen"] for i in held_out], max_len=96)
    r_r = score(model, tok, prompts, [rows[i]["rejected"] for i in held_out], max_len=96)
    assert float((r_c > r_r).float().mean()) == metrics["rm/accuracy"]
    assert abs(float(bradley_terry_loss(r_c, r_r).mean()) - metrics["rm/loss"]) < 1e-5
    # A user string prompt is the same as a one-message prompt: scored alone, bit for bit (a
    # batch of one is compared with a batch of one, since fp32 reductions may differ with the
    # batch shape on some CPUs), and equal to its score inside the held-out batch within fp32 rounding.
    first = rows[held_out[0]]
    as_text = score(model, tok, [first["prompt"][0]["content"]], [first["chosen"]], max_len=96)
    assert torch.equal(as_text, score(model, tok, [first["prompt"]], [first["chosen"]], max_len=96))
    assert torch.allclose(as_text, r_c[:1], rtol=1e-5, atol=1e-6)


def test_bad_inputs_raise_clear_errors(setup, tmp_path):
    root, _, _ = setup
    tok = load_tokenizer(root / "base")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"})
        + "\n"
        + json.dumps({"prompt": [{"role": "user", "content": "q"}], "chosen": "a"})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: rejected: expected a string"):
        encode_preference_dataset(bad, tok, 64)
    with pytest.raises(ValueError, match="lacks"):
        load_reward_model(root / "base")
    with pytest.raises(ValueError, match="at least 2 preference pairs"):
        split_eval(1, 0.2, seed=0)


class Crash(RuntimeError):
    pass


def model_dir_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every GPT weight of a model directory plus its ``heads.safetensors`` tensors."""
    loaded = load_model_dir(model_dir)
    out = {k: v for k, v in loaded.model.state_dict().items() if isinstance(v, torch.Tensor)}
    return {**out, **loaded.heads}


def crash_after(step: int, logged: list[tuple[int, dict]]):
    """A log_metrics that records ``(step, metrics)`` and raises :class:`Crash` at ``step``."""

    def log(metrics: dict, done: int) -> None:
        logged.append((done, dict(metrics)))
        if done == step:
            raise Crash()

    return log


def untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "perf/pairs_per_s"}


def test_resume_after_a_crash_ends_with_identical_weights_and_head(setup, tmp_path):
    """6 steps straight (no checkpoints) vs. checkpoints every 2 steps and a crash at step 5
    (done, not checkpointed); a freshly built trainer resumes at step 4 (past an epoch end:
    60 training pairs, 16 a step) and ends with every GPT weight and the head bit-identical,
    and the logged metrics of steps 5 and 6 equal. log_every and checkpoint_every may change
    across the resume; any other config change is refused; a finished state only rewrites
    the model directory."""
    from engine.storage.train_state import DataPosition, load_train_state

    root, data, _ = setup
    cfg = RMConfig(
        precision="fp32",
        steps=6,
        global_batch_size=16,
        micro_batch_size=8,
        max_seq_len=96,
        eval_fraction=0.25,
        optim=OptimConfig(lr=3e-3, warmup_steps=2, weight_decay=0.1, grad_clip=0.5),
        checkpoint_every=2,
        log_every=1,
    )
    straight_log: list[tuple[int, dict]] = []
    straight = train_reward_model(
        reward_trainer,
        root / "base",
        data,
        cfg,
        tmp_path / "straight",
        None,
        seed=0,
        log_metrics=lambda m, s: straight_log.append((s, dict(m))),
    )
    assert (straight["train/resumed_from_step"], straight["train/steps_run"]) == (0.0, 6.0)

    resume = tmp_path / "resume"
    first_log: list[tuple[int, dict]] = []
    with pytest.raises(Crash):
        train_reward_model(
            reward_trainer,
            root / "base",
            data,
            cfg,
            tmp_path / "resumed",
            resume,
            seed=0,
            log_metrics=crash_after(5, first_log),
        )
    assert not (tmp_path / "resumed").exists()
    state = load_train_state(resume)
    assert state.step == 4 and state.data_position == DataPosition(1, 4, 0)  # 64 pairs drawn of 60
    assert [untimed(m) for _, m in first_log] == [untimed(m) for _, m in straight_log[:5]]

    later = cfg.model_copy(update={"log_every": 2, "checkpoint_every": 5})  # neither changes the result
    resumed_log: list[tuple[int, dict]] = []
    resumed = train_reward_model(
        reward_trainer,
        root / "base",
        data,
        later,
        tmp_path / "resumed",
        resume,
        seed=0,
        log_metrics=lambda m, s: resumed_log.append((s, dict(m))),
    )
    assert [s for s, _ in resumed_log] == [6]  # steps 5 and 6 ran; step 6 is logged (log_every 2)
    assert (resumed["train/resumed_from_step"], resumed["train/steps_run"], resumed["train/steps"]) == (4.0, 2.0, 6.0)
    assert untimed(resumed_log[0][1]) == untimed(straight_log[5][1])
    assert untimed(resumed) == untimed(straight) | {"train/resumed_from_step": 4.0, "train/steps_run": 2.0}
    assert load_train_state(resume).step == 6

    a, b = model_dir_tensors(tmp_path / "straight"), model_dir_tensors(tmp_path / "resumed")
    assert a.keys() == b.keys() and {"reward_head.weight", "reward_head.bias"} <= a.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    base = model_dir_tensors(root / "base")
    assert [k for k in base if not torch.equal(base[k], a[k])]  # it trained

    # A finished state: no step runs, the same weights and metrics are written again.
    again_log: list[int] = []
    again = train_reward_model(
        reward_trainer,
        root / "base",
        data,
        cfg,
        tmp_path / "again",
        resume,
        seed=0,
        log_metrics=lambda m, s: again_log.append(s),
    )
    assert again_log == [] and (again["train/resumed_from_step"], again["train/steps_run"]) == (6.0, 0.0)
    assert untimed(again) == untimed(resumed) | {"train/resumed_from_step": 6.0, "train/steps_run": 0.0}
    c = model_dir_tensors(tmp_path / "again")
    assert [k for k in a if not torch.equal(a[k], c[k])] == []

    with pytest.raises(ValueError, match="train state was written by a different run"):
        train_reward_model(
            reward_trainer, root / "base", data, cfg.model_copy(update={"steps": 7}), tmp_path / "x", resume, seed=0
        )
    with pytest.raises(ValueError, match="different run"):
        train_reward_model(reward_trainer, root / "base", data, cfg, tmp_path / "x", resume, seed=1)
