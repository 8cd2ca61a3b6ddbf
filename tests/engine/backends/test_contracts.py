"""The backend contracts (engine.training.contracts) against both backends.

Signatures (no model): every method of ActorTrainer, CriticTrainer and RewardTrainer exists
on the megatron-core and the DeepSpeed class with the same parameters (names, kinds, order,
the protocol's defaults) and, where both annotate them, the same types; the constructors
take what engine.rl.workers.start_workers and engine.backends.select_rm.reward_trainer pass.
So does the training loop's StepTrainer (engine.training.loop) on every trainer the loop runs:
both reward trainers and, for sft and po (megatron only), engine.training.model_trainer.ModelTrainer.

Behaviour (in process, no Ray): one tiny Qwen2 (hidden 64, two layers whose MLPs make the
HF weights about 3 MiB, so weight sync at 1 MiB has several buckets; tied embeddings,
vocabulary padded from 300 to 384 rows) and one batch of six responses; each backend's
actor, critic and reward trainer called through the protocol methods, with the results'
types, shapes and keys, the state round trips, and the two backends' log-probs, values,
bucket plans and first reward-model loss compared on the same weights; the loop run over each
backend's reward trainer, crashed and resumed, ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import inspect
import math
import pickle
import typing
from pathlib import Path

import pytest
import torch

from config.rl import EngineConfig, RLConfig
from engine.algorithms.aggregation import GlobalNorm  # noqa: F401  (the self-test classes annotate with it)
from engine.backends.select import actor_worker_class, critic_worker_class
from engine.models.weight_buckets import BucketPlan, load_group
from engine.rollout.base import RolloutOutput
from engine.storage.train_state import DataPosition, TrainState
from engine.training.actor import ActorUpdate
from engine.training.contracts import ActorTrainer, CriticTrainer
from engine.training.loop import StepTrainer
from engine.training.model_trainer import ModelTrainer
from engine.training.reward_contract import RewardTrainer
from engine.trajectory import Trajectory
from tests.engine.backends.test_deepspeed_backend import with_targets, zero_vocab_padding
from tests.engine.backends.test_deepspeed_critic_rm import rl_config, rm_config, targets

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

BACKENDS = ("megatron", "deepspeed")

ACTOR_METRICS = {
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "actor/kl_loss",
}  # kl_loss: the batch has reference log-probs
CRITIC_METRICS = {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"}
RM_METRICS = {"loss", "accuracy", "margin", "grad_norm", "lr", "num_units"}


def _rl_worker_init(self, policy_dir, cfg, seed=0, num_threads=None):
    """The constructor engine.rl.workers.start_workers calls: ``cls(policy_dir, cfg, seed, threads)``."""


def _reward_trainer_init(self, base_model_dir, cfg, seed=0):
    """The constructor engine.backends.select_rm.reward_trainer calls: ``cls(base_model_dir, cfg, seed)``."""


def _model_trainer_init(self, model, optimizer, scheduler, loss_fn, grad_clip):
    """The constructor engine.training.sft and engine.training.preference_optimization call."""


def loop_trainers(backend: str) -> list[tuple[type, typing.Callable]]:
    """``(class, reference constructor)`` of each trainer engine.training.loop.run_loop runs on
    ``backend``: the reward trainer, and on megatron also the sft/po ModelTrainer (those stages
    have no DeepSpeed backend)."""
    out = [(reward_trainer_class(backend), _reward_trainer_init)]
    return out + [(ModelTrainer, _model_trainer_init)] if backend == "megatron" else out


def reward_trainer_class(backend: str) -> type:
    """The reward trainer class of ``rm.backend`` (``engine.backends.select_rm.reward_trainer``
    constructs it)."""
    if backend == "megatron":
        from engine.backends.megatron.reward_model import MegatronRewardTrainer

        return MegatronRewardTrainer
    from engine.backends.deepspeed.reward_model import DeepSpeedRewardTrainer

    return DeepSpeedRewardTrainer


def implementations(backend: str) -> list[tuple[type, type, typing.Callable]]:
    """``(protocol, class, reference constructor)`` of each role on ``backend``."""
    cfg = RLConfig(backend=backend)
    return [
        (ActorTrainer, actor_worker_class(cfg), _rl_worker_init),
        (CriticTrainer, critic_worker_class(cfg), _rl_worker_init),
        (RewardTrainer, reward_trainer_class(backend), _reward_trainer_init),
    ]


def protocol_methods(protocol: type) -> list[str]:
    """The methods a protocol declares (its own, not ``Protocol``'s)."""
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]


# Ray's tracing hook adds this keyword to every method of a class once ``ray.remote`` has wrapped
# it (in place), e.g. after an RL run in this process; it is Ray's, not the backend's.
RAY_INJECTED = ("_ray_trace_ctx",)


def own_signature(fn: typing.Callable) -> inspect.Signature:
    """``inspect.signature(fn)`` without the parameters Ray injects (``RAY_INJECTED``)."""
    sig = inspect.signature(fn)
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in RAY_INJECTED])


def parameters(sig: inspect.Signature) -> list[tuple[str, inspect._ParameterKind]]:
    """``(name, kind)`` of each parameter, in order."""
    return [(p.name, p.kind) for p in sig.parameters.values()]


# ----------------------------------------------------------------------------- signatures (fast)


def test_protocols_hold_the_methods_the_rl_loop_calls():
    """The method sets, so an added call in engine.rl, or a removed one, is a visible change here."""
    assert set(protocol_methods(ActorTrainer)) == {
        "compute_logprobs",
        "update",
        "hf_bucket_plan",
        "hf_bucket",
        "save_state",
        "load_state",
        "save_model",
    }
    assert set(protocol_methods(CriticTrainer)) == {
        "compute_values",
        "update",
        "save_state",
        "prune_states",
        "load_state",
    }
    assert set(protocol_methods(RewardTrainer)) == {"step", "save", "save_state", "load_state"}
    assert typing.get_type_hints(RewardTrainer)["model"] is typing.Any


def test_the_loop_contract_holds_what_run_loop_calls():
    assert set(protocol_methods(StepTrainer)) == {"step", "save_state", "load_state"}
    assert typing.get_type_hints(StepTrainer)["model"] is typing.Any


def signature_problems(protocol: type, cls: type, init: typing.Callable) -> list[str]:
    """Where ``cls`` departs from ``protocol``: a method missing or not a plain function, other
    parameters (names, kinds, order), another default where the protocol has one, another
    type where both annotate a parameter or the result; a constructor other than ``init``'s
    (parameters and defaults)."""
    problems = []
    for name in protocol_methods(protocol):
        impl = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(impl):
            problems.append(f"{cls.__name__}.{name}: missing or not a plain method")
            continue
        want, got = inspect.signature(getattr(protocol, name)), own_signature(impl)
        if parameters(got) != parameters(want):
            problems.append(f"{cls.__name__}.{name}{got}: the protocol has {want}")
            continue
        problems += [
            f"{cls.__name__}.{name}: {p.name}={got.parameters[p.name].default!r}, the protocol has {p.default!r}"
            for p in want.parameters.values()
            if p.default is not p.empty and got.parameters[p.name].default != p.default
        ]
        want_types, got_types = typing.get_type_hints(getattr(protocol, name)), typing.get_type_hints(impl)
        problems += [
            f"{cls.__name__}.{name}: {key} is {got_types[key]}, the protocol has {want_types[key]}"
            for key in sorted(want_types.keys() & got_types.keys())
            if got_types[key] != want_types[key]
        ]
    want, got = inspect.signature(init), own_signature(cls.__init__)
    if parameters(got) != parameters(want) or [p.default for p in got.parameters.values()] != [
        p.default for p in want.parameters.values()
    ]:
        problems.append(f"{cls.__name__}{got}: its callers pass {want}")
    return problems


@pytest.mark.parametrize("backend", BACKENDS)
def test_signatures_match_the_protocols(backend):
    """Every protocol method is a plain method of the class with the protocol's parameters
    (names, kinds and order; the protocol's defaults) and, where both annotate a parameter
    or the result, the same type; the constructors take the arguments their callers pass."""
    for protocol, cls, init in implementations(backend):
        assert signature_problems(protocol, cls, init) == []
        if protocol is not RewardTrainer:  # a data member (``model``) rules out issubclass
            assert issubclass(cls, protocol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loop_trainers_match_the_step_trainer_contract(backend):
    """Every trainer the shared loop runs has StepTrainer's methods, parameters and types."""
    for cls, init in loop_trainers(backend):
        assert signature_problems(StepTrainer, cls, init) == []


def test_the_signature_check_finds_departures():
    """The check is not vacuous: a renamed parameter, a changed default, another type and a
    missing method are each reported."""
    from engine.backends.megatron.critic import CriticWorker

    class Renamed(CriticWorker):
        def load_state(self, directory, step):  # resume_dir renamed
            ...

    class Departs(CriticWorker):
        def __init__(self, policy_dir, cfg, seed=1, num_threads=None): ...

        def update(self, traj: Trajectory, norm: GlobalNorm | None = None) -> float: ...

        prune_states = None

    assert signature_problems(CriticTrainer, CriticWorker, _rl_worker_init) == []
    assert signature_problems(CriticTrainer, Renamed, _rl_worker_init) == [
        "Renamed.load_state(self, directory, step): the protocol has "
        "(self, resume_dir: 'str | Path', step: 'int') -> 'None'"
    ]
    problems = signature_problems(CriticTrainer, Departs, _rl_worker_init)
    assert len(problems) == 3 and problems[0].startswith("Departs.update: return is <class 'float'>")
    assert problems[1] == "Departs.prune_states: missing or not a plain method"
    assert problems[2].startswith("Departs(self, policy_dir, cfg, seed=1, num_threads=None): its callers pass")


# ----------------------------------------------------------------------------- behaviour on a tiny model


def trajectory() -> Trajectory:
    """Two prompts x three responses of random tokens, lengths 1-6 (test_deepspeed_backend's
    shape, token ids below the model's 300): six rows, micro-batches of 4 + 2."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14]]
    outs = [
        [RolloutOutput(tuple(torch.randint(3, 300, (n,), generator=gen).tolist()), (-1.0,) * n, "stop") for n in row]
        for row in ([1, 4, 2], [6, 3, 5])
    ]
    return Trajectory.from_rollout(prompts, outs, pad_id=0)


def preference_micro_batches() -> list:
    """Two micro-batches of two (chosen, rejected) pairs of random tokens, collated as
    engine.training.reward_model does."""
    from engine.training.preference_data import collate_pairs

    gen = torch.Generator().manual_seed(1)

    def seq(n: int) -> list[int]:
        return torch.randint(3, 300, (n,), generator=gen).tolist()

    return [collate_pairs([(seq(5), seq(3)), (seq(4), seq(6))], pad_id=0) for _ in range(2)]


def check_row_tensor(t: torch.Tensor, traj: Trajectory) -> None:
    """A ``[B, L]`` float32 result: 0 on padding, finite on the response tokens."""
    valid = traj.response_valid.bool()
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == traj.response_ids.shape
    assert not t.requires_grad and t.device.type == "cpu"
    assert bool((t[~valid] == 0).all()) and bool(torch.isfinite(t).all())


def check_metrics(metrics, keys: set[str]) -> None:
    """A metrics dict with exactly ``keys``, each a finite float."""
    assert isinstance(metrics, dict) and set(metrics) == keys, sorted(metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()), metrics


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, fixtures_dir) -> dict:
    """The tiny policy's model directory, the batch, and each backend's actor, critic and
    reward trainer on it, with the log-probs and values they give before any update."""
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir

    root = tmp_path_factory.mktemp("contracts")
    spec = GPTSpec(
        architecture="qwen2",
        vocab_size=300,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        ffn_hidden_size=2048,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    )
    model = build_gpt_model(spec.with_vocab_padding(128), seed=0)
    zero_vocab_padding(model, spec.vocab_size)
    policy_dir = save_model_dir(
        root / "policy",
        model,
        spec.to_hf_config() | {"eos_token_id": 2, "pad_token_id": 0},
        fixtures_dir / "qwen2.5-tokenizer",
    )
    traj = trajectory()
    out: dict = {"dir": policy_dir, "traj": traj, "actor": {}, "critic": {}, "rm": {}, "logprobs": {}, "values": {}}
    for backend in BACKENDS:
        cfg = rl_config(backend, engine=EngineConfig(weight_sync_bucket_mb=1))
        out["actor"][backend] = actor_worker_class(cfg)(policy_dir, cfg, 0)
        out["critic"][backend] = critic_worker_class(cfg)(policy_dir, cfg, 3)
        out["rm"][backend] = reward_trainer_class(backend)(policy_dir, rm_config(backend, steps=4), 0)
        out["logprobs"][backend] = out["actor"][backend].compute_logprobs(traj)
        out["values"][backend] = out["critic"][backend].compute_values(traj)
    return out


def test_both_backends_agree_on_the_same_weights(tiny):
    """Log-probs and values within 1e-5 of each other (the bound of test_deepspeed_backend and
    test_deepspeed_critic_rm), and weight-sync plans over the same tensors (names, shapes,
    dtypes; the megatron converter streams them in another order)."""
    lp, values = tiny["logprobs"], tiny["values"]
    valid = tiny["traj"].response_valid.bool()
    assert bool((lp["megatron"][valid] < 0).all())
    assert (lp["deepspeed"] - lp["megatron"]).abs().max().item() <= 1e-5
    assert bool((values["megatron"][valid] != 0).all())
    assert (values["deepspeed"] - values["megatron"]).abs().max().item() <= 1e-5
    actors = tiny["actor"]
    plans = {backend: actor.hf_bucket_plan() for backend, actor in actors.items()}
    assert set(plans["deepspeed"].tensors) == set(plans["megatron"].tensors)
    assert len(plans["deepspeed"].tensors) == len(plans["megatron"].tensors)


@pytest.mark.parametrize("backend", BACKENDS)
def test_actor_results(tiny, backend, tmp_path):
    """compute_logprobs ``[B, L]`` float32; update an ActorUpdate with the ``actor/*`` metrics
    and the old log-probs it used; buckets that follow the plan and together are the HF
    model's weights; save_state/load_state returns ``(step, data_position, extra)`` and
    restores the weights; save_model writes a model directory."""
    from engine.storage.model_dir import load_model_dir

    actor, traj = tiny["actor"][backend], tiny["traj"]
    assert isinstance(actor, ActorTrainer)
    lp = actor.compute_logprobs(traj)
    check_row_tensor(lp, traj)

    position, extra = DataPosition(1, 4, 7), {"history": [{"actor/pg_loss": 0.5}], "seed": 0}
    actor.save_state(tmp_path / "resume", 3, position, extra)
    update = actor.update(with_targets(traj, lp))
    assert isinstance(update, ActorUpdate)
    check_metrics(update.metrics, ACTOR_METRICS)
    check_row_tensor(update.old_logprobs, traj)
    assert torch.equal(update.old_logprobs, lp)  # the batch's own
    on_policy = actor.update(with_targets(traj, lp).with_(old_logprobs=None))  # from the first forward
    check_row_tensor(on_policy.old_logprobs, traj)
    assert not torch.equal(on_policy.old_logprobs, lp)  # the weights moved
    assert actor.load_state(tmp_path / "resume") == (3, position, extra)
    assert torch.equal(actor.compute_logprobs(traj), lp)

    plan = actor.hf_bucket_plan()
    assert isinstance(plan, BucketPlan) and plan.bucket_bytes == 2**20 and plan.num_buckets >= 3
    assert pickle.loads(pickle.dumps(plan)) == plan
    buckets = [actor.hf_bucket(i) for i in range(plan.num_buckets)]
    module = actor.module if backend == "deepspeed" else actor.model
    live = {p.untyped_storage().data_ptr() for p in module.parameters()}
    for index, bucket in enumerate(buckets):
        assert isinstance(bucket, list)
        assert [(n, tuple(t.shape), t.dtype) for n, t in bucket] == [
            (m.name, m.shape, m.dtype) for m in plan.bucket(index)
        ]
        assert all(
            isinstance(n, str)
            and isinstance(t, torch.Tensor)
            and t.is_contiguous()
            and t.device.type == "cpu"
            and t.untyped_storage().data_ptr() not in live
            for n, t in bucket
        )
    groups = [{load_group(n) for n, _ in b} for b in buckets]
    assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1 :])  # no load group split
    # the names and shapes the HF model (the rollout engine's) has: every parameter, the tied lm_head once
    hf = tiny["actor"]["deepspeed"].module
    synced = {n: t for b in buckets for n, t in b}
    assert synced.keys() == dict(hf.named_parameters()).keys() and "lm_head.weight" not in synced
    assert all(synced[n].shape == p.shape for n, p in hf.named_parameters())
    with pytest.raises(IndexError):
        actor.hf_bucket(plan.num_buckets)

    saved = actor.save_model(tmp_path / "model", 2)
    assert isinstance(saved, str) and Path(saved) == tmp_path / "model"
    assert (Path(saved) / "megatron" / "iter_0000002").is_dir()
    assert load_model_dir(saved).spec.padded_vocab_size == 384


@pytest.mark.parametrize("backend", BACKENDS)
def test_critic_results(tiny, backend, tmp_path):
    """compute_values ``[B, L]`` float32; update the ``critic/*`` metrics; save_state per
    step, prune_states keeping one, load_state restoring the values (None returned) and
    refusing a step it has no state for."""
    critic, traj = tiny["critic"][backend], tiny["traj"]
    assert isinstance(critic, CriticTrainer)
    values = critic.compute_values(traj)
    check_row_tensor(values, traj)
    critic.save_state(tmp_path, 1, DataPosition(0, 6, 0), {})
    check_metrics(critic.update(targets(traj, values)), CRITIC_METRICS)
    moved = critic.compute_values(traj)
    critic.save_state(tmp_path, 2, DataPosition(0, 12, 0), {})
    critic.prune_states(tmp_path, 1)
    assert sorted(p.name for p in (tmp_path / "critic").iterdir()) == ["step_00000001"]
    assert not torch.equal(moved, values)
    assert critic.load_state(tmp_path, 1) is None
    assert torch.equal(critic.compute_values(traj), values)
    with pytest.raises(FileNotFoundError):
        critic.load_state(tmp_path, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reward_trainer_results(tiny, backend, tmp_path):
    """step returns the documented metrics; save_state/load_state returns the TrainState
    (step, data position, extra) and restores the weights; save returns the model directory's
    Path; the model maps ``(input_ids [B, T], lengths [B])`` to rewards ``[B]``. The trainer
    is left with its starting weights."""
    from engine.training.reward_model import evaluate_pairs

    trainer = tiny["rm"][backend]
    assert isinstance(trainer, RewardTrainer)
    micro = preference_micro_batches()
    trainer.save_state(tmp_path / "state", 5, DataPosition(2, 8, 1), {"note": "kept"})
    metrics = trainer.step(micro)
    check_metrics(metrics, RM_METRICS)
    assert metrics["num_units"] == 4.0  # pairs
    batch = micro[0]
    with torch.no_grad():
        trainer.model.eval()
        rewards = trainer.model(batch.input_ids, batch.lengths)
        trainer.model.train()
    assert rewards.shape == (4,) and rewards.dtype == torch.float32
    state = trainer.load_state(tmp_path / "state")
    assert isinstance(state, TrainState)
    assert (state.step, state.data_position, state.extra) == (5, DataPosition(2, 8, 1), {"note": "kept"})
    assert trainer.step(micro)["loss"] == metrics["loss"]  # the same weights again
    trainer.load_state(tmp_path / "state")  # back to the start, for test_reward_trainers_start_alike
    pairs = [
        (batch.input_ids[i, : batch.lengths[i]].tolist(), batch.input_ids[i + 2, : batch.lengths[i + 2]].tolist())
        for i in range(2)
    ]
    assert set(evaluate_pairs(trainer.model, pairs, 0, 2)) == {"rm/accuracy", "rm/loss"}

    saved = trainer.save(tmp_path / "rm", iteration=1)
    assert isinstance(saved, Path) and saved == tmp_path / "rm"
    assert (saved / "megatron" / "iter_0000001").is_dir() and (saved / "heads.safetensors").is_file()


def test_reward_trainers_start_alike(tiny, tmp_path):
    """The same body and reward head on both backends: the first step's loss (taken before the
    weights move) within 1e-5. Both trainers are then restored to their start."""
    micro = preference_micro_batches()
    losses = {}
    for backend in BACKENDS:
        trainer = tiny["rm"][backend]
        trainer.save_state(tmp_path / backend, 0, DataPosition(0, 0, 0), {})
        losses[backend] = trainer.step(micro)["loss"]
        trainer.load_state(tmp_path / backend)
    assert losses["deepspeed"] == pytest.approx(losses["megatron"], abs=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_loop_resumes_bit_identical_on_each_backend(tiny, backend, tmp_path):
    """engine.training.loop.run_loop with the rm stage's RMStage over the backend's reward trainer:
    three steps straight, and a run that crashes after step 3 is logged (last checkpoint: step 2)
    and resumes, end with the same metrics (held-out ones included) and rewards, bit for bit. The
    trainer is restored to its start afterwards."""
    from engine.training.loop import run_loop
    from engine.training.reward_model import RMStage

    trainer = tiny["rm"][backend]
    assert isinstance(trainer, StepTrainer)
    trainer.save_state(tmp_path / "start", 0, DataPosition(0, 0, 0), {})
    gen = torch.Generator().manual_seed(2)
    pairs = [
        (torch.randint(3, 300, (n,), generator=gen).tolist(), torch.randint(3, 300, (n + 1,), generator=gen).tolist())
        for n in range(3, 11)
    ]
    cfg = rm_config(backend, steps=3, global_batch_size=4, micro_batch_size=2, log_every=1, checkpoint_every=2)
    batch = preference_micro_batches()[0]

    def run(resume_dir, log=None):
        result = run_loop(
            trainer,
            RMStage(pairs[:6], pairs[6:], cfg, 0),
            cfg,
            num_examples=6,
            seed=1,
            identity={"backend": backend},
            resume_dir=resume_dir,
            log_metrics=log,
            desc="rm",
            label="rm",
        )
        with torch.no_grad():
            trainer.model.eval()
            rewards = trainer.model(batch.input_ids, batch.lengths)
            trainer.model.train()
        return result, rewards

    def crash_at_3(metrics, step):
        if step == 3:
            raise RuntimeError("crash")

    try:
        straight, rewards = run(tmp_path / "a")
        trainer.load_state(tmp_path / "start")
        with pytest.raises(RuntimeError, match="crash"):
            run(tmp_path / "b", crash_at_3)
        seen: list[int] = []
        resumed, resumed_rewards = run(tmp_path / "b", lambda m, s: seen.append(s))
    finally:
        trainer.load_state(tmp_path / "start")
    assert seen == [3] and resumed.start == 2
    assert {"rm/accuracy", "rm/loss", "train/loss"} <= set(straight.metrics)
    assert {k: v for k, v in resumed.metrics.items() if not k.startswith("perf/")} == {
        k: v for k, v in straight.metrics.items() if not k.startswith("perf/")
    }
    assert torch.equal(resumed_rewards, rewards)
