"""The DeepSpeed backend of the PPO critic (engine.backends.deepspeed.critic) and of the reward model
(engine.backends.deepspeed.reward_model) against their megatron counterparts.

In process (no Ray): the DeepSpeed critic's values, one clipped-value-loss update (metrics
and weights, ZeRO 0-3) and its train state against engine.backends.megatron.critic.CriticWorker on the same
model directory; the DeepSpeed reward model trained by train_reward_model against the
megatron one (held-out metrics, training curve), its model directory read back exactly by
load_model_dir / load_reward_model, and an untied output layer kept as it was. Then a short
PPO run (rl.algorithm gae) on Ray with rl.backend deepspeed, which needs engine.rl.loop's
start_workers to spawn backends.critic_worker_class(cfg).

Reuses test_deepspeed_backend's tiny Qwen2 policy (tied embeddings, megatron vocabulary
padded from 280 to 384 rows, SFT'd on one-digit sums) and test_reward_model's learnable
preference pairs on a random base model (real alpaca instructions; approving vs
disapproving words).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from config.rl import CriticConfig, EngineConfig, RLConfig, RolloutConfig
from config.rm import RMConfig
from config.training import OptimConfig
from conversion.registry import megatron_to_hf
from engine.models.megatron import mcore_state
from engine.storage.train_state import DataPosition
from tests.engine.backends.test_deepspeed_backend import STAGES, batch, first_step_gain, policy, question  # noqa: F401
from tests.engine.backends.test_deepspeed_backend import rl_config as actor_rl_config
from tests.engine.training.test_reward_model import setup  # noqa: F401

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

CRITIC_LR, CRITIC_WD = 1e-3, 0.1


def rl_config(backend: str = "deepspeed", stage: int = 2, **overrides) -> RLConfig:
    """PPO (gae) with a critic schedule that has warm-up, cosine decay, weight decay and
    clipping (0.5, below the first gradient norm) and a value clip range of 0.2."""
    fields = dict(
        algorithm="gae",
        critic=CriticConfig(
            optim=OptimConfig(lr=CRITIC_LR, min_lr=1e-4, warmup_steps=1, weight_decay=CRITIC_WD, grad_clip=0.5),
            cliprange_value=0.2,
        ),
        deepspeed={"zero_stage": stage, "param_persistence_threshold": 0},
    )
    fields.update(overrides)
    return actor_rl_config(backend, stage, **fields)


def targets(traj, values: torch.Tensor):
    """Old values 0.1-0.3 away from the current ones (some beyond the clip range, so the
    clipped branch is taken) and returns of both signs."""
    mask = traj.response_mask
    offsets = torch.tensor([0.3, -0.1, 0.25, -0.3, 0.05, -0.15])[:, None]
    returns = torch.linspace(-1.0, 1.0, len(traj))[:, None] * mask
    return traj.with_(values=(values + offsets) * mask, returns=returns)


def megatron_critic_weights(critic, hf_config: dict) -> dict[str, torch.Tensor]:
    """HF-named body weights and the value head of engine.backends.megatron.critic.CriticWorker (copies)."""
    out = {k: v.clone() for k, v in megatron_to_hf(hf_config, mcore_state(critic.model.gpt))}
    out.update({f"value_head.{k}": v.detach().clone() for k, v in critic.model.value_head.named_parameters()})
    return out


def deepspeed_weights(trainer, body_prefix: str = "model.") -> dict[str, torch.Tensor]:
    """HF-named body weights and the head of a DeepSpeedTrainer's module (copies)."""
    return {
        (body_prefix + k[len("body.") :] if k.startswith("body.") else k): v.clone() for k, v in trainer.named_tensors()
    }


@pytest.fixture(scope="module")
def hf_config(policy) -> dict:
    return json.loads((Path(policy["dir"]) / "hf" / "config.json").read_text())


@pytest.fixture(scope="module")
def megatron_critic(policy, hf_config) -> dict:
    """The megatron critic's values, one update's metrics and its weights before and after."""
    from engine.backends.megatron.critic import CriticWorker

    critic = CriticWorker(policy["dir"], rl_config("megatron"), seed=3)
    traj = batch(policy["tokenizer"], seed=0)
    values = critic.compute_values(traj)
    before = megatron_critic_weights(critic, hf_config)
    metrics = critic.update(targets(traj, values))
    return {
        "traj": traj,
        "values": values,
        "before": before,
        "metrics": metrics,
        "after": megatron_critic_weights(critic, hf_config),
    }


# ----------------------------------------------------------------------------- critic


def test_config_selects_the_backends():
    from engine.backends.deepspeed.critic import DeepSpeedCriticWorker
    from engine.backends.megatron.critic import CriticWorker
    from engine.backends.select import critic_worker_class
    from engine.backends.select_rm import reward_trainer

    assert critic_worker_class(RLConfig()) is CriticWorker
    assert critic_worker_class(rl_config(stage=3)) is DeepSpeedCriticWorker
    assert RMConfig().backend == "megatron" and RMConfig().deepspeed.zero_stage == 2
    assert RMConfig(backend="deepspeed", deepspeed={"zero_stage": 3}).deepspeed.zero_stage == 3
    with pytest.raises(ValueError, match="backend"):
        RMConfig(backend="fsdp")
    with pytest.raises(ValueError, match="zero_stage"):
        RMConfig(deepspeed={"zero_stage": 4})
    unknown = RMConfig.model_construct(**{**RMConfig().model_dump(), "backend": "fsdp"})
    with pytest.raises(ValueError, match="rm.backend: unknown backend 'fsdp'"):
        reward_trainer("unused", unknown)


def test_critic_values_equal_the_megatron_critic(policy, megatron_critic):
    """Same body weights (exactly), the same head for the same seed (exactly), values within
    1e-5 at the same positions; 0 on padding."""
    from engine.backends.deepspeed.critic import DeepSpeedCriticWorker

    traj, expected = megatron_critic["traj"], megatron_critic["values"]
    ds = DeepSpeedCriticWorker(policy["dir"], rl_config(stage=2), seed=3)
    start = deepspeed_weights(ds.trainer)
    assert start.keys() == megatron_critic["before"].keys()
    assert all(torch.equal(start[k], megatron_critic["before"][k]) for k in start)
    values = ds.compute_values(traj)
    valid = traj.response_valid.bool()
    diff = (values - expected).abs().max().item()
    print(f"critic values: max |DeepSpeed - megatron| = {diff:.3g}")
    assert values.shape == (6, 6) and bool((values[~valid] == 0).all()) and bool((values[valid] != 0).all())
    assert diff <= 1e-5
    assert ds.engine.training  # compute_values restores train mode


@pytest.mark.parametrize("stage", STAGES)
def test_critic_update_equals_the_megatron_critic(policy, megatron_critic, stage):
    """One clipped-value-loss step (warm-up lr, weight decay, clipping, some values clipped):
    the same loss, clip fraction and mean value (1e-6), gradient norm (1e-5 relative) and
    weights as the megatron critic: within 1e-6 where AdamW's first step is stable and within
    5% of lr on the few elements whose gradient is near AdamW's eps (see
    test_deepspeed_backend.first_step_gain)."""
    from engine.backends.deepspeed.critic import DeepSpeedCriticWorker

    ds = DeepSpeedCriticWorker(policy["dir"], rl_config(stage=stage), seed=3)
    traj = megatron_critic["traj"]
    metrics = ds.update(targets(traj, megatron_critic["values"]))
    ref = megatron_critic["metrics"]
    assert 0 < ref["critic/vf_clipfrac"] < 1
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"):
        assert metrics[key] == pytest.approx(ref[key], abs=1e-6), key
    assert metrics["critic/lr"] == ref["critic/lr"] == CRITIC_LR
    assert ref["critic/grad_norm"] > 0.5  # clipping is active
    assert metrics["critic/grad_norm"] == pytest.approx(ref["critic/grad_norm"], rel=1e-5)
    after, before, expected = deepspeed_weights(ds.trainer), megatron_critic["before"], megatron_critic["after"]
    assert after.keys() == expected.keys()
    stable_worst, sensitive_worst, sensitive, total = 0.0, 0.0, 0, 0
    for k in expected:
        diff = (expected[k] - after[k]).abs()
        gain = first_step_gain(before[k], expected[k], CRITIC_LR, CRITIC_WD)
        stable = (gain >= 0.9) | (gain <= 1e-4)
        total, sensitive = total + diff.numel(), sensitive + int((~stable).sum())
        stable_worst = max(stable_worst, diff[stable].max().item())
        sensitive_worst = max(sensitive_worst, diff[~stable].max().item() if (~stable).any() else 0.0)
    dloss = max(abs(metrics[k] - ref[k]) for k in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"))
    dnorm = abs(metrics["critic/grad_norm"] / ref["critic/grad_norm"] - 1)
    print(
        f"critic ZeRO-{stage}: max |d loss metrics| {dloss:.3g}, grad norm rel. diff {dnorm:.3g}; max |dw| "
        f"{stable_worst:.3g} on {total - sensitive} stable elements, {sensitive_worst:.3g} on {sensitive} with "
        f"|g| near eps (of {total})"
    )
    assert sensitive / total < 0.05
    assert stable_worst <= 1e-6 and sensitive_worst <= 5e-2 * CRITIC_LR


@pytest.mark.parametrize("stage", STAGES)
def test_critic_state_round_trip(policy, tmp_path, stage):
    """save_state/load_state restore the weights with the head, AdamW and the schedule bit
    for bit (another head seed is overwritten); the next update is identical; only the kept
    step survives prune_states; a missing step and a megatron critic's state are refused."""
    from engine.backends.deepspeed.critic import DeepSpeedCriticWorker
    from engine.backends.megatron.critic import CriticWorker

    cfg = rl_config(stage=stage)
    traj = batch(policy["tokenizer"], seed=1)
    a = DeepSpeedCriticWorker(policy["dir"], cfg)
    a.update(targets(traj, a.compute_values(traj)))
    a.save_state(tmp_path, 1, DataPosition(0, 6, 0), {})
    a.update(targets(traj, a.compute_values(traj)))
    a.save_state(tmp_path, 2, DataPosition(0, 12, 0), {"note": "kept"})
    a.prune_states(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "critic").iterdir()) == ["step_00000002"]

    b = DeepSpeedCriticWorker(policy["dir"], cfg, seed=7)
    b.load_state(tmp_path, 2)
    wa, wb = deepspeed_weights(a.trainer), deepspeed_weights(b.trainer)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.trainer.scheduler.last_epoch == b.trainer.scheduler.last_epoch == 2
    values_a, values_b = a.compute_values(traj), b.compute_values(traj)
    assert torch.equal(values_a, values_b)
    assert a.update(targets(traj, values_a)) == b.update(targets(traj, values_b))
    wa, wb = deepspeed_weights(a.trainer), deepspeed_weights(b.trainer)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(FileNotFoundError, match="no critic train state for step 1"):
        b.load_state(tmp_path, 1)
    CriticWorker(policy["dir"], rl_config("megatron")).save_state(tmp_path / "megatron", 1, DataPosition(0, 0, 0), {})
    with pytest.raises(ValueError, match=r"written with \{'backend': 'megatron'\}.*rl.backend"):
        b.load_state(tmp_path / "megatron", 1)


# ----------------------------------------------------------------------------- reward model


@pytest.fixture(scope="module")
def preferences(policy, tmp_path_factory) -> Path:
    """50 pairs on the policy's task: the correct sum of two digits is chosen, a sum 1-3 off
    is rejected."""
    path = tmp_path_factory.mktemp("ds_rm") / "prefs.jsonl"
    rows = [
        {"prompt": question(a, b), "chosen": str(a + b), "rejected": str(a + b + 1 + (a * 5 + b + k) % 3)}
        for a in range(5)
        for b in range(5)
        for k in range(2)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


RM_OPTIM = OptimConfig(lr=3e-3, warmup_steps=3, weight_decay=0.1, grad_clip=0.5)


def rm_config(backend: str, **overrides) -> RMConfig:
    """test_reward_model's schedule (12 steps, warm-up, held-out quarter) plus weight decay
    and a clip below the early gradient norms."""
    fields = dict(
        steps=12,
        global_batch_size=16,
        micro_batch_size=8,
        max_seq_len=96,
        eval_fraction=0.25,
        log_every=4,
        optim=RM_OPTIM,
        backend=backend,
        deepspeed={"zero_stage": 2},
        precision="fp32",
    )  # fp32 claims (auto would be bf16 on AMX machines)
    fields.update(overrides)
    return RMConfig(**fields)


@pytest.fixture(scope="module")
def megatron_rm(setup, tmp_path_factory) -> dict:
    """The megatron reward model trained on test_reward_model's learnable preferences (random
    base model, approving vs disapproving words)."""
    from engine.backends.select_rm import reward_trainer
    from engine.training.reward_model import train_reward_model

    root, data, _ = setup
    out = tmp_path_factory.mktemp("megatron_rm") / "rm"
    logged: list[tuple[int, dict]] = []
    metrics = train_reward_model(
        reward_trainer,
        root / "base",
        data,
        rm_config("megatron"),
        out,
        seed=0,
        log_metrics=lambda m, s: logged.append((s, dict(m))),
    )
    return {"dir": out, "metrics": metrics, "logged": logged}


@pytest.mark.parametrize("stage", (2, 3))
def test_reward_model_trains_like_the_megatron_one(setup, megatron_rm, tmp_path, stage):
    """train_reward_model with rm.backend deepspeed: the same held-out rm/accuracy (>= 0.9)
    and, at every logged step, held-out and training losses, margins and gradient norms
    within small bounds of the megatron backend's (same data order, head and schedule);
    load_reward_model + score on the saved directory reproduce the held-out metrics."""
    from engine.backends.select_rm import reward_trainer
    from engine.storage.model_dir import load_tokenizer
    from engine.training.reward_model import bradley_terry_loss, split_eval, train_reward_model
    from engine.training.reward_scoring import load_reward_model, score

    root, data, rows = setup
    cfg = rm_config("deepspeed", deepspeed={"zero_stage": stage, "param_persistence_threshold": 0})
    logged: list[tuple[int, dict]] = []
    metrics = train_reward_model(
        reward_trainer,
        root / "base",
        data,
        cfg,
        tmp_path / "rm",
        seed=0,
        log_metrics=lambda m, s: logged.append((s, dict(m))),
    )
    ref = megatron_rm["metrics"]
    assert [s for s, _ in logged] == [s for s, _ in megatron_rm["logged"]] == [4, 8, 12]
    assert (metrics["rm/num_train_pairs"], metrics["rm/num_eval_pairs"]) == (60.0, 20.0)
    worst: dict[str, float] = {}
    for (_, got), (_, want) in zip(logged, megatron_rm["logged"]):
        assert got["rm/accuracy"] == want["rm/accuracy"]
        assert got["train/accuracy"] == want["train/accuracy"]
        assert got["train/lr"] == pytest.approx(want["train/lr"], rel=1e-12)
        for key in ("rm/loss", "train/loss", "train/margin", "train/grad_norm"):
            worst[key] = max(worst.get(key, 0.0), abs(got[key] - want[key]))
    print(
        f"RM ZeRO-{stage} vs megatron, max |diff| over logged steps: "
        + ", ".join(f"{k} {v:.3g}" for k, v in worst.items())
        + f"; rm/accuracy {metrics['rm/accuracy']}, rm/loss {metrics['rm/loss']:.6g} vs {ref['rm/loss']:.6g}"
    )
    assert ref["rm/accuracy"] >= 0.9 and ref["rm/loss"] < math.log(2) - 0.2  # it learned the preference
    assert worst["rm/loss"] <= 2e-5 and worst["train/loss"] <= 2e-5
    assert worst["train/margin"] <= 1e-4 and worst["train/grad_norm"] <= 5e-4

    # the saved directory, read by the megatron-side loader, scores the held-out pairs alike
    model, tok = load_reward_model(tmp_path / "rm", "fp32"), load_tokenizer(tmp_path / "rm")
    _, held_out = split_eval(len(rows), cfg.eval_fraction, seed=0)
    prompts = [rows[i]["prompt"] for i in held_out]
    r_c = score(model, tok, prompts, [rows[i]["chosen"] for i in held_out], max_len=96)
    r_r = score(model, tok, prompts, [rows[i]["rejected"] for i in held_out], max_len=96)
    assert float((r_c > r_r).float().mean()) == metrics["rm/accuracy"]
    assert abs(float(bradley_terry_loss(r_c, r_r).mean()) - metrics["rm/loss"]) < 1e-5


def test_reward_model_directory_reads_back_exactly(policy, preferences, tmp_path):
    """A DeepSpeedRewardTrainer trained a few steps and saved: load_model_dir gives its body
    weights bit for bit (megatron's padding rows zero), heads.safetensors its head, and the
    rewards load_reward_model computes from the directory equal the trainer's in-memory
    rewards exactly (the HF and megatron forwards run the same operations on CPU)."""
    from engine.backends.deepspeed.reward_model import DeepSpeedRewardTrainer
    from engine.batching.collate import split_micro_batches
    from engine.storage.model_dir import load_model_dir, load_tokenizer
    from engine.training.preference_data import collate_pairs, encode_preference_dataset
    from engine.training.reward_scoring import load_reward_model, score

    tok = load_tokenizer(policy["dir"])
    pairs = encode_preference_dataset(preferences, tok, 64)
    trainer = DeepSpeedRewardTrainer(policy["dir"], rm_config("deepspeed", steps=3), seed=0)
    for step in range(3):
        chunk = pairs[8 * step : 8 * step + 8]
        out = trainer.step([collate_pairs(c, tok.pad_token_id) for c in split_micro_batches(chunk, 4)])
        assert out["num_units"] == 8 and math.isfinite(out["loss"])
    saved = trainer.save(tmp_path / "rm", iteration=3)
    assert (saved / "megatron" / "iter_0000003").is_dir()

    loaded = load_model_dir(saved)
    embedding = loaded.model.embedding.word_embeddings.weight
    assert embedding.shape == (384, 64) and not embedding[280:].any()
    back = dict(megatron_to_hf(loaded.hf_config, mcore_state(loaded.model)))
    trained = trainer.hf_state()
    assert back.keys() == trained.keys() and all(torch.equal(back[k], trained[k]) for k in trained)
    heads = trainer.heads()
    assert loaded.heads.keys() == heads.keys() == {"reward_head.weight", "reward_head.bias"}
    assert all(torch.equal(loaded.heads[k], heads[k]) for k in heads)

    model = load_reward_model(saved, "fp32")
    held_out = pairs[40:]
    batch_ = collate_pairs(held_out, tok.pad_token_id)
    with torch.no_grad():
        trainer.model.eval()
        in_memory = trainer.model(batch_.input_ids, batch_.lengths)
        from_disk = model(batch_.input_ids, batch_.lengths)
    diff = (in_memory - from_disk).abs().max().item()
    print(f"RM rewards: max |in-memory DeepSpeed - load_reward_model| = {diff:.3g}")
    assert torch.equal(in_memory, from_disk)
    prompts = [question(a, b) for a in range(2) for b in range(5)]
    rewards = score(model, tok, prompts, [str(a + b) for a in range(2) for b in range(5)], max_len=64)
    assert rewards.shape == (10,) and bool(torch.isfinite(rewards).all())


def test_reward_model_keeps_an_untied_output_layer(fixtures_dir, tmp_path):
    """An untied Llama: the output layer is not part of the reward model, so the saved
    directory holds it unchanged while the body has moved."""
    from conversion.spec import GPTSpec
    from engine.backends.deepspeed.reward_model import DeepSpeedRewardTrainer
    from engine.batching.collate import collate_tokens
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import load_model_dir, save_model_dir
    from tests.engine.backends.test_deepspeed_backend import zero_vocab_padding

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
    save_model_dir(
        tmp_path / "base", model, spec.to_hf_config() | {"eos_token_id": 2}, fixtures_dir / "qwen2.5-tokenizer"
    )
    start = mcore_state(load_model_dir(tmp_path / "base").model)
    # One step, so a one-step warm-up (the schema refuses a warm-up longer than the run);
    # the step runs at the full lr, so the body moves.
    one_step = RM_OPTIM.model_copy(update={"warmup_steps": 1})
    trainer = DeepSpeedRewardTrainer(tmp_path / "base", rm_config("deepspeed", steps=1, optim=one_step), seed=0)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 3, 4, 6)]
    trainer.step([collate_tokens(seqs, None, 0)])
    final = mcore_state(load_model_dir(trainer.save(tmp_path / "rm", iteration=1)).model)
    assert torch.equal(final["output_layer.weight"], start["output_layer.weight"])
    assert not torch.equal(final["embedding.word_embeddings.weight"], start["embedding.word_embeddings.weight"])
    assert not final["embedding.word_embeddings.weight"][300:].any()


@pytest.mark.parametrize("stage", (2, 3))
def test_reward_model_resumes_to_identical_weights_and_head(setup, tmp_path, stage):
    """rm.backend deepspeed: 6 steps straight vs. checkpoints every 2 steps and a crash at
    step 5; a freshly built DeepSpeedRewardTrainer resumes at step 4 (its state tagged with the
    ZeRO stage) and the written model directory, every body weight and the head, is
    bit-identical to the straight run's, as are the metrics of the resumed steps."""
    from engine.backends.select_rm import reward_trainer
    from engine.storage.train_state import load_train_state
    from engine.training.reward_model import train_reward_model
    from tests.engine.training.test_reward_model import Crash, crash_after, model_dir_tensors, untimed

    root, data, _ = setup
    cfg = rm_config(
        "deepspeed",
        steps=6,
        checkpoint_every=2,
        log_every=1,
        deepspeed={"zero_stage": stage, "param_persistence_threshold": 0},
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

    resume = tmp_path / "resume"
    with pytest.raises(Crash):
        train_reward_model(
            reward_trainer,
            root / "base",
            data,
            cfg,
            tmp_path / "resumed",
            resume,
            seed=0,
            log_metrics=crash_after(5, []),
        )
    state = load_train_state(resume)
    assert state.step == 4 and state.data_position == DataPosition(1, 4, 0)
    assert state.extra["rm_backend"] == {"backend": "deepspeed", "zero_stage": stage}

    resumed_log: list[tuple[int, dict]] = []
    resumed = train_reward_model(
        reward_trainer,
        root / "base",
        data,
        cfg,
        tmp_path / "resumed",
        resume,
        seed=0,
        log_metrics=lambda m, s: resumed_log.append((s, dict(m))),
    )
    assert [s for s, _ in resumed_log] == [5, 6]
    assert (resumed["train/resumed_from_step"], resumed["train/steps_run"]) == (4.0, 2.0)
    assert [untimed(m) for _, m in resumed_log] == [untimed(m) for _, m in straight_log[4:]]
    assert untimed(resumed) == untimed(straight) | {"train/resumed_from_step": 4.0, "train/steps_run": 2.0}

    a, b = model_dir_tensors(tmp_path / "straight"), model_dir_tensors(tmp_path / "resumed")
    assert a.keys() == b.keys() and {"reward_head.weight", "reward_head.bias"} <= a.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    base = model_dir_tensors(root / "base")
    assert [k for k in base if not torch.equal(base[k], a[k])]  # it trained


def test_reward_model_state_of_the_other_backend_is_refused(setup, tmp_path):
    """A megatron reward-model state given to the DeepSpeed trainer names rm.backend; a
    DeepSpeed one given to the megatron trainer names the mismatched weights."""
    from engine.backends.deepspeed.reward_model import DeepSpeedRewardTrainer
    from engine.backends.megatron.reward_model import MegatronRewardTrainer

    root, _, _ = setup
    MegatronRewardTrainer(root / "base", rm_config("megatron")).save_state(
        tmp_path / "megatron", 1, DataPosition(0, 0, 0), {}
    )
    ds = DeepSpeedRewardTrainer(root / "base", rm_config("deepspeed"))
    ds.save_state(tmp_path / "deepspeed", 1, DataPosition(0, 0, 0), {})
    with pytest.raises(
        ValueError, match=r"written with \{'backend': 'megatron'\}.*rm.backend and rm.deepspeed.zero_stage"
    ):
        ds.load_state(tmp_path / "megatron")
    with pytest.raises(ValueError, match=r"does not match the model: mismatched keys \['gpt\."):
        MegatronRewardTrainer(root / "base", rm_config("megatron")).load_state(tmp_path / "deepspeed")


# ----------------------------------------------------------------------------- on Ray


def test_ppo_run_on_ray_with_the_deepspeed_backend(policy, tmp_path):
    """Two PPO steps (gae, KL in the reward) with vLLM rollout, a ZeRO-2 actor and a ZeRO-2
    critic: finite critic metrics, the first epoch starts at V == V_old (clip fraction 0),
    and the checkpoint holds the DeepSpeed critic's state next to the DeepSpeed actor's.
    Needs engine.rl.workers.start_workers to spawn engine.backends.select.critic_worker_class(cfg)."""
    from config.rl import KLConfig
    from engine.rl.loop import run_rl
    from engine.storage.train_state import load_train_state

    cfg = rl_config(
        stage=2,
        steps=2,
        prompts_per_step=8,
        n_samples=4,
        micro_batch_size=16,
        checkpoint_every=1,
        kl=KLConfig(coef=0.05, in_reward=True),
        deepspeed={"zero_stage": 2},
        rollout=RolloutConfig(backend="vllm", temperature=1.0, max_new_tokens=6),
        engine=EngineConfig(num_cpus=2),
    )
    result = run_rl(
        policy["dir"], policy["prompts"], cfg, tmp_path / "out", tmp_path / "resume", seed=0
    )  # the cluster stays up
    assert (result["rl/steps"], result["rl/steps_run"]) == (2.0, 2.0)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout_vs_trainer/logprob_diff_max"] < 1e-4
        for key in (
            "critic/vf_loss",
            "critic/vpred_mean",
            "critic/grad_norm",
            "critic/values/mean",
            "critic/returns/mean",
            "actor/pg_loss",
            "actor/grad_norm",
        ):
            assert math.isfinite(r[key]), (r["step"], key)
        assert r["critic/vf_clipfrac"] == 0.0 and r["critic/vf_loss"] > 0
        assert r["critic/advantages/mean"] == pytest.approx(0.0, abs=1e-5)  # whitened GAE advantages
    actor = load_train_state(tmp_path / "resume")
    assert actor.step == 2 and actor.extra["actor_backend"] == {"backend": "deepspeed", "zero_stage": 2}
    assert sorted(p.name for p in (tmp_path / "resume" / "critic").iterdir()) == ["step_00000002"]
    critic = load_train_state(tmp_path / "resume" / "critic" / "step_00000002")
    assert critic.step == 2
    assert critic.extra.get("critic_backend") == {"backend": "deepspeed", "zero_stage": 2}, (
        "the megatron CriticWorker wrote the critic state: engine.rl.workers.start_workers must spawn "
        "engine.backends.select.critic_worker_class(cfg)"
    )
    assert "value_head.weight" in critic.model and "body.embed_tokens.weight" in critic.model
