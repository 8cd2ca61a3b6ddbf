"""bf16 mixed precision in training: bit-identical resume, fp32 checkpoints, and the megatron
RL/reward-model backends (actor, critic, reward trainer) with the inference-only models
(reference, RL reward model) in the compute dtype.

Every test pins ``precision="bf16"`` and uses a tiny model (hidden 32, one layer, 16-token
rows): bf16 matmuls are emulated (slow) on CPUs without avx512_bf16/AMX.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from config.rl import KLConfig, RLConfig, RolloutConfig
from config.rm import RMConfig
from config.training import OptimConfig
from conversion.spec import GPTSpec
from engine.models.master_weights import master_params
from engine.rollout.base import RolloutOutput
from engine.trajectory import Trajectory

VOCAB = 64
SPEC = GPTSpec(
    architecture="qwen2",
    vocab_size=VOCAB,
    hidden_size=32,
    num_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    ffn_hidden_size=64,
    max_position_embeddings=64,
    rope_theta=1e4,
    norm_epsilon=1e-6,
    add_qkv_bias=True,
    tie_word_embeddings=True,
    head_dim=16,
)


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def masters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: m.detach().clone() for k, m in master_params(model).items()}


def assert_all_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_masters_are_fp32_state(model: torch.nn.Module, state: dict[str, torch.Tensor], prefix: str = "") -> None:
    """``state`` (read back from disk) holds, for every master of ``model`` under ``prefix``,
    exactly its fp32 values; and the masters are not all bf16-representable (so fp32 storage
    is what kept them, not a bf16 round trip)."""
    masters = {k[len(prefix) :]: m for k, m in master_params(model).items() if k.startswith(prefix)}
    assert masters and set(masters) <= set(state)
    for k, m in masters.items():
        assert state[k].dtype == torch.float32 and torch.equal(state[k], m.detach()), k
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters.values())


# ----------------------------------------------------------------------------- resume


def next_token_loss(model, ids: torch.Tensor):
    from engine.models.megatron import gpt_logits

    logits = gpt_logits(model, ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum")
    return loss, ids[:, 1:].numel(), {}


def test_bf16_resume_is_bit_identical_and_checkpoints_hold_the_masters(tmp_path, fixtures_dir):
    """Train 4 steps (2 micro-batches each) under bf16, saving the train state after step 2;
    a fresh model (another init seed) built with build_model_optimizer bf16 that loads it and
    runs steps 3-4 ends with the same fp32 masters, bf16 weights, AdamW moments and schedule,
    bit for bit. The model directory saved at the end holds the fp32 masters (torch_dist), and
    loading it in bf16 gives the trained bf16 weights exactly (both are round-to-nearest-even of
    the same fp32 values)."""
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import load_model_dir, save_model_dir
    from engine.storage.train_state import DataPosition, load_train_state, save_train_state
    from engine.training.optimizer_step import build_model_optimizer, train_step

    optim = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=1, weight_decay=0.1, grad_clip=1.0)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (4, 16), generator=gen) for _ in range(4)]

    def run(model, optimizer, scheduler, steps):
        for s in steps:
            train_step(model, optimizer, scheduler, [batches[s][:2], batches[s][2:]], next_token_loss, optim.grad_clip)

    a = build_gpt_model(SPEC, seed=0, core_attention="sdpa")
    opt_a, sch_a = build_model_optimizer(a, optim, 4, "bf16")
    run(a, opt_a, sch_a, [0, 1])
    save_train_state(
        tmp_path / "state", step=2, model=a, optimizer=opt_a, scheduler=sch_a, data_position=DataPosition(0, 2, 0)
    )
    at_k = masters_of(a)
    run(a, opt_a, sch_a, [2, 3])

    b = build_gpt_model(SPEC, seed=1, core_attention="sdpa")
    opt_b, sch_b = build_model_optimizer(b, optim, 4, "bf16")
    load_train_state(tmp_path / "state").restore(b, opt_b, sch_b)
    assert_all_equal(masters_of(b), at_k)
    run(b, opt_b, sch_b, [2, 3])

    assert next(b.parameters()).dtype == torch.bfloat16
    assert all(m.dtype == torch.float32 for m in master_params(b).values())
    assert_all_equal(masters_of(b), masters_of(a))
    assert_all_equal(tensors(b), tensors(a))  # the bf16 compute weights
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"] and state_a["state"].keys() == state_b["state"].keys()
    for i, s in state_a["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert s[key].dtype == state_b["state"][i][key].dtype and torch.equal(s[key], state_b["state"][i][key]), (
                i,
                key,
            )
        assert s["exp_avg"].dtype == torch.float32  # the moments are fp32 (they belong to the masters)
    assert sch_a.state_dict() == sch_b.state_dict()

    out = save_model_dir(tmp_path / "model", a, SPEC.to_hf_config(), fixtures_dir / "qwen2.5-tokenizer", iteration=4)
    assert_masters_are_fp32_state(a, tensors(load_model_dir(out).model))
    assert_all_equal(tensors(load_model_dir(out, dtype=torch.bfloat16).model), tensors(a))


# ----------------------------------------------------------------------------- backends


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, fixtures_dir):
    """A tiny fp32 model directory (the tokenizer files are only copied: the tests feed token ids)."""
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir

    return save_model_dir(
        tmp_path_factory.mktemp("mp") / "policy",
        build_gpt_model(SPEC, seed=4),
        SPEC.to_hf_config(),
        fixtures_dir / "qwen2.5-tokenizer",
    )


def trajectory() -> Trajectory:
    """2 prompts x 2 responses of random tokens, with advantages and old/ref log-probs."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 3)]
    outs = [
        [RolloutOutput(tuple(torch.randint(1, VOCAB, (n,), generator=gen).tolist()), (-4.0,) * n, "stop") for n in ns]
        for ns in ([4, 2], [3, 5])
    ]
    traj = Trajectory.from_rollout(prompts, outs, pad_id=0)
    mask = traj.response_mask
    old = (-4.2 + 0.3 * torch.randn(mask.shape, generator=gen)) * mask
    return traj.with_(
        advantages=torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]) * mask, old_logprobs=old, ref_logprobs=old - 0.05 * mask
    )


def rl_config(**overrides) -> RLConfig:
    fields = dict(
        precision="bf16",
        micro_batch_size=2,
        ppo_epochs=1,
        steps=1,
        kl=KLConfig(coef=0.1),
        optim=OptimConfig(lr=1e-3, min_lr=1e-3),
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=8),
    )
    return RLConfig(**{**fields, **overrides})


def test_actor_and_reference_under_bf16(policy_dir, tmp_path):
    """ActorWorker: a bf16 GPTModel with fp32 masters; one update moves the masters; weight
    sync streams the bf16 compute weights (HF names, half the bytes of fp32), equal to
    megatron_to_hf of the model; the saved policy holds the fp32 masters. ReferenceWorker under
    bf16: a frozen bf16 model without masters whose log-probs equal the actor's before the
    update bit for bit (both round the same fp32 weights to bf16)."""
    from conversion.registry import megatron_to_hf
    from engine.backends.megatron.actor import ActorWorker
    from engine.models.megatron import mcore_state
    from engine.rl.workers import ReferenceWorker
    from engine.storage.model_dir import load_model_dir

    traj = trajectory()
    actor = ActorWorker(policy_dir, rl_config(), num_threads=1)
    ref = ReferenceWorker(policy_dir, 1.0, 2, num_threads=1, precision="bf16")
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in ref.model.parameters())
    assert master_params(ref.model) is None and not ref.model.training
    before = actor.compute_logprobs(traj)
    assert before.dtype == torch.float32 and torch.equal(ref.compute_logprobs(traj), before)

    masters = masters_of(actor.model)
    metrics = actor.update(traj).metrics
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert all(p.dtype == torch.bfloat16 for p in actor.model.parameters())
    moved = masters_of(actor.model)
    assert all(m.dtype == torch.float32 for m in moved.values()) and any(
        not torch.equal(moved[k], masters[k]) for k in moved
    )

    plan = actor.hf_bucket_plan()
    streamed = [pair for i in range(plan.num_buckets) for pair in actor.hf_bucket(i)]
    expected = list(megatron_to_hf(actor.hf_config, mcore_state(actor.model)))
    assert [n for n, _ in streamed] == [n for n, _ in expected]
    for (name, got), (_, want) in zip(streamed, expected):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    assert plan.total_bytes == 2 * sum(t.numel() for _, t in expected)

    out = actor.save_model(tmp_path / "policy", iteration=1)
    assert_masters_are_fp32_state(actor.model, tensors(load_model_dir(out).model))


def test_critic_under_bf16_saves_an_fp32_head(policy_dir, tmp_path):
    """CriticWorker: body and value head bf16 with fp32 masters; fp32 values; one update step
    runs and moves the head's masters; the train state holds the fp32 masters (head included)."""
    from engine.backends.megatron.critic import CriticWorker
    from engine.storage.train_state import DataPosition, load_train_state
    from engine.training.critic import critic_state_dir

    traj = trajectory()
    critic = CriticWorker(policy_dir, rl_config(algorithm="gae", kl=KLConfig(coef=0.05, in_reward=True)), num_threads=1)
    assert critic.model.value_head.weight.dtype == torch.bfloat16
    assert master_params(critic.model)["value_head.weight"].dtype == torch.float32
    values = critic.compute_values(traj)
    assert values.dtype == torch.float32
    head = masters_of(critic.model)["value_head.weight"]
    metrics = critic.update(traj.with_(values=values, returns=traj.response_mask.float()))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert not torch.equal(masters_of(critic.model)["value_head.weight"], head)
    critic.save_state(tmp_path, 1, DataPosition(0, 0, 0), {})
    state = load_train_state(critic_state_dir(tmp_path, 1)).model
    assert_masters_are_fp32_state(critic.model, state)
    assert state["value_head.weight"].dtype == torch.float32 and state["value_head.bias"].dtype == torch.float32


def test_reward_trainer_under_bf16_saves_fp32_and_scores_in_bf16(policy_dir, tmp_path):
    """MegatronRewardTrainer: one bf16 step runs; the model directory holds the fp32 masters,
    of the body (torch_dist) and of the head (heads.safetensors); load_reward_model under bf16
    gives a frozen bf16 model whose scores equal the trainer's bit for bit, under fp32 the
    masters themselves; the RL reward-model worker loads it in the stage's compute dtype."""
    from engine.backends.megatron.reward_model import MegatronRewardTrainer
    from engine.rl.reward_workers import RewardModelWorker
    from engine.storage.model_dir import load_model_dir
    from engine.training.preference_data import collate_pairs
    from engine.training.reward_scoring import load_reward_model

    cfg = RMConfig(precision="bf16", steps=2, global_batch_size=2, micro_batch_size=2, optim=OptimConfig(lr=1e-3))
    trainer = MegatronRewardTrainer(policy_dir, cfg)
    assert trainer.model.reward_head.weight.dtype == torch.bfloat16
    head = masters_of(trainer.model)["reward_head.weight"]
    pairs = [([1, 5, 9, 12, 3], [1, 5, 9, 40]), ([7, 2, 2], [7, 2, 30, 31, 6])]
    metrics = trainer.step([collate_pairs(pairs, 0)])
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert not torch.equal(masters_of(trainer.model)["reward_head.weight"], head)

    out = trainer.save(tmp_path / "rm", iteration=1)
    heads = load_file(str(out / "heads.safetensors"))
    for name in ("reward_head.weight", "reward_head.bias"):
        assert heads[name].dtype == torch.float32 and torch.equal(
            heads[name], master_params(trainer.model)[name].detach()
        )
    assert_masters_are_fp32_state(trainer.model, tensors(load_model_dir(out).model), prefix="gpt.")
    assert trainer.model.reward_head.weight.dtype == torch.bfloat16  # compute weights back after saving

    batch = collate_pairs(pairs, 0)
    trainer.model.eval()
    with torch.no_grad():
        trained = trainer.model(batch.input_ids, batch.lengths)
    rm = load_reward_model(out, "bf16")
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in rm.parameters()) and not rm.training
    with torch.no_grad():
        scored = rm(batch.input_ids, batch.lengths)
    assert scored.dtype == torch.float32 and torch.equal(scored, trained)
    rm32 = load_reward_model(out, "fp32")
    assert rm32.reward_head.weight.dtype == torch.float32
    assert torch.equal(rm32.reward_head.weight, master_params(trainer.model)["reward_head.weight"].detach())

    worker = RewardModelWorker(out, num_threads=1, precision="bf16")
    assert all(p.dtype == torch.bfloat16 for p in worker.model.parameters())
