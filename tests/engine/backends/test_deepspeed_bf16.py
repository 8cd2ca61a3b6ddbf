"""bf16 mixed precision on the DeepSpeed backend (engine.backends.deepspeed.runtime).

In process, on a tiny Qwen2 (hidden 32, one layer, 64-token vocabulary, tied embeddings:
bf16 matmuls are emulated on CPUs without avx512_bf16/AMX, so only a tiny model keeps this
fast), precision pinned in every test. For ZeRO stages 0-3 with ``precision="bf16"``:

- the module computes in bf16 (its rotary buffers stay fp32), DeepSpeed's fp32 masters are
  the fp32 weights it was given, exactly, and the bf16 weights their rounding;
- the gradient the optimizer steps is the fp32 sum of the micro-batches' bf16 gradients,
  bit for bit (not their bf16 sum), and one step (warm-up lr, weight decay, active clipping)
  equals an independent plain-torch implementation of the scheme;
- the train state holds the fp32 masters and resuming from it continues bit for bit;
- the RL actor's model directory holds the fp32 masters.

And ``precision="fp32"`` leaves the DeepSpeed configuration as it was. The fp32 trainers'
agreement with the megatron backend is test_deepspeed_backend.py's and
test_deepspeed_critic_rm.py's.
"""

from __future__ import annotations

import json

import pytest
import torch

from config.training import DeepSpeedConfig, OptimConfig
from engine.models.hf import hf_logits
from engine.storage.train_state import DataPosition, load_train_state
from tests.engine.backends.test_deepspeed_backend import first_step_gain, step_tolerance

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

STAGES = (0, 1, 2, 3)
LR, WD, CLIP = 1e-3, 0.1, 0.5
OPTIM = OptimConfig(lr=LR, min_lr=1e-4, warmup_steps=1, weight_decay=WD, grad_clip=CLIP)
TOTAL_STEPS = 4
VOCAB = 64


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    """fp32 Qwen2 causal LM, hidden 32, 1 layer, 2 heads (1 KV head), tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).float().train()


def micro_batches(seed: int) -> list[torch.Tensor]:
    """Three micro-batches of 2 x 8 random tokens."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 8), generator=gen) for _ in range(3)]


def loss_fn(model, ids: torch.Tensor):
    """Next-token NLL summed over the micro-batch and divided by the whole batch's 3 x 14
    predicted tokens (the ``normalized=True`` contract of DeepSpeedTrainer.train_step)."""
    logp = torch.log_softmax(hf_logits(model, ids[:, :-1]), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -logp.sum() / (3 * logp.numel()), logp.numel(), {}


def trainer(stage: int, precision: str, seed: int = 0):
    from engine.backends.deepspeed.runtime import DeepSpeedTrainer

    return DeepSpeedTrainer(
        tiny_qwen2(seed),
        OPTIM,
        TOTAL_STEPS,
        DeepSpeedConfig(zero_stage=stage, param_persistence_threshold=0),
        2,
        precision,
    )


def masters(tr) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tr.named_tensors(full_precision=True)}


def compute_weights(tr) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tr.named_tensors()}


def reference_step(start: dict[str, torch.Tensor], batches: list[torch.Tensor]) -> dict:
    """The scheme in plain torch, independent of DeepSpeed and engine.models.master_weights: a bf16
    copy of the model (floating buffers kept fp32) computes each micro-batch's gradient in
    bf16; the fp32 masters' gradient is the fp32 sum of those; global-norm clipping to CLIP
    (torch.nn.utils.clip_grad_norm_), AdamW with the repository's groups and schedule
    (engine.training.optimizer_step.build_optimizer) on the masters.

    Returns: the bf16 and fp32 gradient sums (unclipped), the clipped fp32 gradient, the
    masters after the step, the loss and the gradient norm.
    """
    from engine.training.optimizer_step import build_optimizer

    model = tiny_qwen2()
    for name, p in model.named_parameters():
        p.data = start[name].to(torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    fp32_sum = {n: torch.zeros_like(start[n]) for n in names}
    bf16_sum = {n: torch.zeros_like(start[n], dtype=torch.bfloat16) for n in names}
    loss = 0.0
    for ids in batches:
        model.zero_grad(set_to_none=True)
        mb_loss, _, _ = loss_fn(model, ids)
        mb_loss.backward()
        loss += float(mb_loss)
        for n, p in model.named_parameters():
            fp32_sum[n] += p.grad.float()
            bf16_sum[n] += p.grad
    fp32_masters = {n: torch.nn.Parameter(start[n].clone()) for n in names}
    for n, m in fp32_masters.items():
        m.grad = fp32_sum[n].clone()
    optimizer, scheduler = build_optimizer(fp32_masters.values(), OPTIM, TOTAL_STEPS)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(list(fp32_masters.values()), CLIP))
    clipped = {n: m.grad.clone() for n, m in fp32_masters.items()}
    optimizer.step()
    scheduler.step()
    return {
        "fp32_sum": fp32_sum,
        "bf16_sum": bf16_sum,
        "clipped": clipped,
        "loss": loss,
        "grad_norm": grad_norm,
        "after": {n: m.detach().clone() for n, m in fp32_masters.items()},
    }


def capture_step_gradients(tr) -> dict:
    """Record, when the optimizer steps, the fp32 gradient of every parameter it steps
    (DeepSpeed's at ZeRO 1-3, unclipped: DeepSpeed clips inside its step; the trainer's masters'
    at ZeRO-0, clipped by the trainer before)."""
    from deepspeed.utils import safe_get_full_grad

    seen: dict = {}
    optimizer = tr.engine.optimizer
    step = optimizer.step

    def recording_step(*args, **kwargs):
        if tr.scheme == "master_weights":
            from engine.models.master_weights import master_params

            seen.update({n: m.grad.clone() for n, m in master_params(tr.module).items()})
        else:
            seen.update({n: safe_get_full_grad(p).clone() for n, p in tr.module.named_parameters()})
        return step(*args, **kwargs)

    optimizer.step = recording_step
    return seen


def test_engine_config_by_precision():
    """fp32: the configuration the backend has always used, key for key. bf16 at ZeRO 1-3:
    DeepSpeed's bf16 with fp32 gradient accumulation and fp32 gradient reduction; at ZeRO-0:
    DeepSpeed in fp32 without its clipping (the trainer clips the masters)."""
    from engine.backends.deepspeed.runtime import engine_config, precision_scheme

    ds = DeepSpeedConfig(zero_stage=2, param_persistence_threshold=7)
    fp32 = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": 7},
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": None,
        "wall_clock_breakdown": False,
    }
    assert engine_config(ds, 4, 0.5) == engine_config(ds, 4, 0.5, "fp32") == fp32
    assert engine_config(ds, 4, 0.5, "bf16") == fp32 | {
        "bf16": {"enabled": True, "check_grad_overflow": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
    }
    zero0 = DeepSpeedConfig(zero_stage=0)
    assert engine_config(zero0, 4, 0.5, "bf16") == engine_config(zero0, 4, 0.5, "fp32") | {"gradient_clipping": 0.0}
    assert [precision_scheme(s, "bf16") for s in STAGES] == ["master_weights"] + ["deepspeed_bf16"] * 3
    assert {precision_scheme(s, "fp32") for s in STAGES} == {"fp32"}
    with pytest.raises(ValueError, match="precision must be"):
        precision_scheme(2, "fp16")


def test_deepspeed_refuses_bf16_with_fp32_accumulation_below_zero():
    """Why ZeRO-0 uses the repository's master weights: DeepSpeed itself refuses bf16 with fp32
    gradient accumulation without ZeRO."""
    from engine.backends.deepspeed.runtime import engine_config, import_deepspeed, init_process_group
    from engine.training.optimizer_step import build_optimizer

    deepspeed = import_deepspeed()
    init_process_group()
    model = tiny_qwen2()
    optimizer, _ = build_optimizer(model.parameters(), OPTIM, TOTAL_STEPS)
    config = engine_config(DeepSpeedConfig(zero_stage=1), 2, CLIP, "bf16") | {"zero_optimization": {"stage": 0}}
    with pytest.raises(NotImplementedError, match="unsupported mix of model_dtype=torch.bfloat16"):
        deepspeed.initialize(model=model, optimizer=optimizer, config=config)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_step_and_resume(stage, tmp_path):
    """bf16 at ZeRO stage ``stage``: dtypes and masters after construction, the stepped
    gradient and one step against :func:`reference_step`, then save_state / load_state.

    The step's weights are held to test_deepspeed_backend.step_tolerance: two fp32 AdamW
    steps from the same gradients whose clipping coefficients differ by a rounding of the
    global norm (DeepSpeed's ZeRO-3 sums the norm in float64) may differ by that amount, most
    where |g| is near AdamW's eps; the gradients themselves are compared exactly.
    """
    tr = trainer(stage, "bf16")
    start = {k: v.detach().clone() for k, v in tiny_qwen2().named_parameters()}
    assert {p.dtype for p in tr.module.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in tr.module.buffers()} == {torch.float32}  # rotary inverse frequencies
    m0, w0 = masters(tr), compute_weights(tr)
    assert m0.keys() == start.keys() and all(torch.equal(m0[k], start[k]) for k in start)  # exact fp32
    assert all(torch.equal(w0[k], start[k].to(torch.bfloat16)) for k in start)
    assert any(not torch.equal(w0[k].float(), start[k]) for k in start)  # the masters are more than bf16

    batches = micro_batches(seed=1)
    ref = reference_step(start, batches)
    seen = capture_step_gradients(tr)
    out = tr.train_step(batches, loss_fn)
    stepped = ref["clipped"] if stage == 0 else ref["fp32_sum"]
    assert seen.keys() == stepped.keys() and all(seen[k].dtype == torch.float32 for k in seen)
    assert all(torch.equal(seen[k], stepped[k]) for k in stepped)
    differs = sum(int((ref["bf16_sum"][k].float() != ref["fp32_sum"][k]).sum()) for k in stepped)
    assert differs > 1000  # a bf16 accumulation would not have passed the equality above
    assert out["loss"] == pytest.approx(ref["loss"], rel=1e-12)  # the same bf16 forward, summed in float64
    assert out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6) and ref["grad_norm"] > CLIP
    assert out["lr"] == LR
    m1, w1 = masters(tr), compute_weights(tr)
    worst = 0.0
    for k in start:
        gain = first_step_gain(start[k], ref["after"][k], LR, WD)
        bound = step_tolerance(gain, torch.maximum(start[k].abs(), ref["after"][k].abs()), lr=LR, clip=CLIP)
        worst = max(worst, ((m1[k] - ref["after"][k]).abs() / bound).max().item())
    print(f"bf16 ZeRO-{stage}: masters after one step within {worst:.3f} of the tolerance of the reference")
    assert worst <= 1.0
    assert all(m1[k].dtype == torch.float32 and torch.equal(w1[k], m1[k].to(torch.bfloat16)) for k in start)
    assert {s.dtype for st in tr.optimizer.state.values() for s in st.values() if s.dim() > 0} == {torch.float32}

    # resume: the state holds the masters; a fresh trainer (other initial weights) takes step 2 identically
    tr.save_state(tmp_path, "backend", 1, DataPosition(0, 6, 0), {"note": "kept"})
    saved = load_train_state(tmp_path).model
    assert all(saved[k].dtype == torch.float32 and torch.equal(saved[k], m1[k]) for k in m1)
    assert torch.equal(saved["lm_head.weight"], m1["model.embed_tokens.weight"])  # tied
    assert all(p.dtype == torch.bfloat16 for p in tr.module.parameters())  # put back after saving
    second = micro_batches(seed=2)
    out_a = tr.train_step(second, loss_fn)
    other = trainer(stage, "bf16", seed=5)
    state = other.load_state(tmp_path, "backend", "rl.backend and rl.deepspeed.zero_stage")
    assert (state.step, state.data_position, state.extra) == (1, DataPosition(0, 6, 0), {"note": "kept"})
    loaded_m, loaded_w = masters(other), compute_weights(other)
    assert all(torch.equal(loaded_m[k], m1[k]) and torch.equal(loaded_w[k], w1[k]) for k in m1)
    assert other.train_step(second, loss_fn) == out_a
    ma, mb, wa, wb = masters(tr), masters(other), compute_weights(tr), compute_weights(other)
    assert all(torch.equal(ma[k], mb[k]) and torch.equal(wa[k], wb[k]) for k in ma)
    assert tr.scheduler.last_epoch == other.scheduler.last_epoch == 2


def test_fp32_trainer_is_unchanged():
    """precision fp32 at ZeRO-2: no cast, no masters besides the module's own weights, the
    stepped gradient is the fp32 sum of fp32 micro-batch gradients."""
    from engine.models.master_weights import master_params

    tr = trainer(2, "fp32")
    assert tr.scheme == "fp32" and master_params(tr.module) is None
    assert {p.dtype for p in tr.module.parameters()} == {torch.float32}
    assert not tr.engine.bfloat16_enabled() and tr.engine.communication_data_type == torch.float32
    before = compute_weights(tr)
    assert all(torch.equal(before[k], v) for k, v in masters(tr).items())
    out = tr.train_step(micro_batches(seed=1), loss_fn)
    after, full = compute_weights(tr), masters(tr)
    assert all(v.dtype == torch.float32 and torch.equal(full[k], v) for k, v in after.items())
    assert out["grad_norm"] > CLIP and any(not torch.equal(before[k], after[k]) for k in before)


def test_actor_model_directory_holds_the_fp32_masters(fixtures_dir, tmp_path):
    """rl.precision bf16, ZeRO-2: after one update the actor's save_model directory reads back
    (load_model_dir) as the fp32 masters, bit for bit; weight sync sends the bf16 compute
    weights; the critic and the reward model are built in bf16 too."""
    from config.rl import RLConfig, RolloutConfig
    from config.rm import RMConfig
    from conversion.registry import megatron_to_hf
    from conversion.spec import GPTSpec
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker
    from engine.backends.deepspeed.critic import DeepSpeedCriticWorker
    from engine.backends.deepspeed.reward_model import DeepSpeedRewardTrainer
    from engine.models.megatron import build_gpt_model, mcore_state
    from engine.rollout.base import RolloutOutput
    from engine.storage.model_dir import load_model_dir, save_model_dir
    from engine.trajectory import Trajectory
    from tests.engine.backends.test_deepspeed_backend import zero_vocab_padding

    spec = GPTSpec(
        architecture="qwen2",
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        ffn_hidden_size=64,
        max_position_embeddings=32,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    )
    gpt = build_gpt_model(spec.with_vocab_padding(128), seed=0)
    zero_vocab_padding(gpt, VOCAB)
    save_model_dir(
        tmp_path / "base", gpt, spec.to_hf_config() | {"eos_token_id": 2}, fixtures_dir / "qwen2.5-tokenizer"
    )
    cfg = RLConfig(
        steps=1,
        prompts_per_step=1,
        n_samples=2,
        micro_batch_size=1,
        precision="bf16",
        optim=OptimConfig(lr=LR, warmup_steps=1, grad_clip=CLIP),
        deepspeed={"zero_stage": 2},
        rollout=RolloutConfig(backend="hf", max_new_tokens=6),
    )
    actor = DeepSpeedActorWorker(tmp_path / "base", cfg)
    gen = torch.Generator().manual_seed(4)
    outs = [
        [
            RolloutOutput(tuple(torch.randint(3, VOCAB, (n,), generator=gen).tolist()), (-1.0,) * n, "stop")
            for n in (3, 5)
        ]
    ]
    traj = Trajectory.from_rollout([[7, 8, 9, 10]], outs, pad_id=0)
    old = actor.compute_logprobs(traj)
    assert old.dtype == torch.float32
    actor.update(traj.with_(advantages=torch.tensor([1.0, -1.0])[:, None] * traj.response_mask, old_logprobs=old))
    full, synced = masters(actor.trainer), dict(actor.hf_tensors())
    assert {v.dtype for v in synced.values()} == {torch.bfloat16}
    assert all(torch.equal(synced[k], full[k].to(torch.bfloat16)) for k in full)
    loaded = load_model_dir(actor.save_model(tmp_path / "out", iteration=1))
    assert json.loads((tmp_path / "out" / "megatron_spec.json").read_text()) == {"padded_vocab_size": 128}
    back = dict(megatron_to_hf(loaded.hf_config, mcore_state(loaded.model)))
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
    assert any(not torch.equal(full[k], full[k].to(torch.bfloat16).float()) for k in full)  # not bf16 values

    critic = DeepSpeedCriticWorker(tmp_path / "base", cfg.model_copy(update={"algorithm": "gae"}))
    assert critic.trainer.scheme == "deepspeed_bf16" and critic.compute_values(traj).dtype == torch.float32
    rm = DeepSpeedRewardTrainer(
        tmp_path / "base", RMConfig(steps=1, precision="bf16", backend="deepspeed", optim=OptimConfig(warmup_steps=1))
    )
    assert rm.trainer.scheme == "deepspeed_bf16"
    assert {v.dtype for v in rm.hf_state().values()} == {v.dtype for v in rm.heads().values()} == {torch.float32}
