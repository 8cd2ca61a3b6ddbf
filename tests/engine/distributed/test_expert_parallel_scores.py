"""Expert parallelism in the score and value forwards (``gpt_hidden_states``): the rm stage
(``rm.parallel``), the RL critic (``rl.parallel.critic``) and the RL reward model
(``rl.parallel.reward_model``) at DP=2 x EP=2 against DP=1.

One MoE model serves all three: tests/engine/training/test_moe_router.py's tiny Qwen3-MoE (2
layers, hidden 64, 4 experts, top-2) on the quickstart's tokenizer, saved with a reward head,
so it is the rm stage's base, the critic's starting policy and the RL reward model. Every
forward of an expert group runs in lock-step (``engine.models.expert_lockstep``): its ids are
padded to the group's largest shape and a rank with fewer micro-batches runs padding passes
(discarded; in an update back-propagated times 0). Each test checks that its layout makes the
ranks' shapes or micro-batch counts differ, so the padding runs.

Bounds: test_expert_parallel.py's (losses, metrics and gradient norms within 1e-6 of
max(|value|, 1); weights within 1e-2 x lr with at most 1e-4 of them beyond 1e-6); values and
scores within 1e-6. The rm stage's weights and later gradient norms are looser, for the reason
given at ``RM_GRAD_REL``; its step-1 gradients are compared tensor by tensor instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config.parallel import ParallelConfig, RLParallelConfig
from config.rm import RMConfig
from config.training import OptimConfig
from tests.engine.distributed.test_data_parallel import _close, rl_config, trajectory
from tests.engine.distributed.test_data_parallel_stages import LR, _killed_at_dp2_and_resumed_at_dp1
from tests.engine.distributed.test_expert_parallel_rl import even_and_uneven_batches

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

EP2 = ParallelConfig(data_parallel_size=2, expert_model_parallel_size=2)
EP2_TP2 = ParallelConfig(
    data_parallel_size=2, tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True
)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, Path]:
    """The quickstart's preference pairs and the tiny Qwen3-MoE with a reward head (seed 0)."""
    from engine.models.heads import RewardModel
    from engine.storage.model_dir import load_tokenizer, save_model_dir
    from tests.engine.training.quickstart_data import make_quickstart_inputs
    from tests.engine.training.test_moe_router import HIDDEN, build, moe_config

    root = tmp_path_factory.mktemp("ep_scores")
    inputs = make_quickstart_inputs(root / "data", num_sft=8, num_preference=20)
    vocab = 300  # the trajectories' random token ids are below 300; the tokenizer's below it too
    assert len(load_tokenizer(inputs["base"])) <= vocab
    model = build(None, vocab)
    heads = RewardModel(model, HIDDEN).heads()
    cfg = moe_config(vocab) | {"eos_token_id": 2, "pad_token_id": 0}
    moe_dir = save_model_dir(root / "moe", model, cfg, inputs["base"] / "hf", heads=heads)
    return {"model": moe_dir, "preference": inputs["preference"]}


@pytest.fixture(scope="module")
def ray_cluster():
    from engine.distributed.cluster import init_ray

    init_ray(num_cpus=2)  # idempotent: the cluster of the other distributed tests when it runs already
    yield


def _packed_tokens_per_rank(cfg: RMConfig, model_dir: Path, dataset: Path) -> list[list[int]]:
    """Each data-parallel rank's packed micro-batch sizes (tokens) of the rm stage's first step."""
    from tests.engine.distributed.expert_ranks import rm_first_step_micro_batches

    sizes = [mb.packed.num_tokens for mb in rm_first_step_micro_batches(cfg, model_dir, dataset)[1]]
    return [sizes[r::2] for r in range(2)]


def _rm_config(**overrides) -> RMConfig:
    """Packed rm steps of 4 micro-batches of 2 pairs (2 per rank at DP=2), 4 held-out pairs
    evaluated at every step, clipping below the first gradient norm."""
    fields = dict(
        precision="fp32",
        steps=3,
        global_batch_size=8,
        micro_batch_size=2,
        packing=True,
        max_seq_len=64,
        eval_fraction=0.2,
        optim=OptimConfig(lr=LR, warmup_steps=1, weight_decay=0.01, grad_clip=0.05),
        checkpoint_every=2,
        log_every=1,
    )
    return RMConfig(**(fields | overrides))


# The rm stage's AdamW steps amplify fp32 rounding more than sft's: its gradients are small
# (the reward head starts at N(0, 1/65), so the body's largest is ~1e-2) and the reward head's
# bias has an analytically zero gradient (it shifts both rewards of a pair), so its first steps
# are lr times the sign of rounding noise, whatever the layout. Measured at EP=2: 55 of 162,305
# weights beyond 1e-6 after 2 steps (at most 1.4e-5, 0.7% of lr); at DP=2 x EP=1 none but the
# bias. The step-1 gradients, the well-conditioned quantity, are checked per tensor instead.
RM_GRAD_REL = 1e-5  # max |dg| / max |g| per tensor; measured 4.8e-6 (expert tensors, summed in another order)


def _rm_weights_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    """The sft bounds' maximum (1e-2 x lr) on every weight but the reward head's bias, and at
    most 1e-3 of them beyond 1e-6 (see above)."""
    keys = [k for k, v in a.items() if isinstance(v, torch.Tensor) and k != "reward_head.bias"]
    assert keys and "reward_head.weight" in keys and set(keys) <= set(b)
    diff = torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in keys])
    beyond = int((diff > 1e-6).sum())
    print(f"{what}: max |dW| {float(diff.max()):.3g}, {beyond} of {diff.numel()} beyond 1e-6")
    assert float(diff.max()) < 1e-2 * LR, what
    assert beyond <= 1e-3 * diff.numel(), what


def test_rm_first_step_gradients_at_dp2_ep2_equal_dp1(moe, ray_cluster):
    """Every gradient of the rm stage's first step (packed, the two ranks' rows of different
    lengths, so each forward pads one of them) at DP=2 x EP=2 against DP=1, tensor by tensor,
    every expert at its global index: within ``RM_GRAD_REL`` of the tensor's largest entry."""
    from engine.distributed.stage_group import run_stage
    from tests.engine.distributed.expert_ranks import rm_first_step_gradients

    cfg = _rm_config()
    ranks = _packed_tokens_per_rank(cfg, moe["model"], moe["preference"])
    assert ranks[0] != ranks[1], ranks  # the lock-step pads a packed row
    want = rm_first_step_gradients(cfg, moe["model"], moe["preference"])
    ep_cfg = cfg.model_copy(update={"parallel": EP2})
    have = run_stage(
        rm_first_step_gradients, dict(cfg=ep_cfg, model_dir=moe["model"], dataset=moe["preference"]), EP2, "rm"
    )
    assert have.keys() == want.keys() and sum(".local_experts.3." in k for k in want) == 2 * 2
    worst = 0.0
    for name, g in want.items():
        assert (g is None) == (have[name] is None), name  # the unused output layer has none at any layout
        if g is None:
            continue
        rel = float((have[name] - g).abs().max()) / max(float(g.abs().max()), 1e-30)
        worst = max(worst, rel)
        assert rel <= RM_GRAD_REL, (name, rel)
    print(f"rm step-1 gradients, DP=2 x EP=2 vs DP=1: worst max |dg| / max |g| {worst:.3g}")
    assert want["gpt.output_layer.weight"] is None


def test_rm_stage_at_dp2_ep2_equals_dp1_and_its_checkpoint_resumes_at_dp1(moe, ray_cluster, tmp_path):
    """Three packed rm steps at DP=1 and at DP=2 x EP=2 (every step evaluated on the held-out
    pairs by every rank), the EP run killed after step 3 and its step-2 state resumed at DP=1
    (``_killed_at_dp2_and_resumed_at_dp1``, weights by :func:`_rm_weights_close`). Step 1 within
    the EP tests' 1e-6 of max(|value|, 1); later steps too, but the gradient norm, which carries
    the first steps' AdamW amplification (above), within 1e-5.

    Measured (fp32, CPU): see docs/conversion.md, Expert parallelism (the rm stage)."""
    from engine.backends.select_rm import reward_trainer
    from engine.training.reward_model import train_reward_model

    cfg = _rm_config()
    data = dict(make_trainer=reward_trainer, base_model_dir=moe["model"], dataset_path=moe["preference"])
    one, two, final, resumed = _killed_at_dp2_and_resumed_at_dp1(
        train_reward_model, "rm", cfg, data, tmp_path, layout=EP2, weights_close=_rm_weights_close
    )
    keys = ("train/loss", "train/accuracy", "train/margin", "train/grad_norm", "rm/accuracy", "rm/loss")
    for step in (1, 2, 3):
        for key in keys:
            print(f"rm step {step} {key}: dp1 {one[step][key]!r} dp2 x ep2 {two[step][key]!r}")
            rel = 1e-5 if key == "train/grad_norm" and step > 1 else 1e-6
            assert _close(two[step][key], one[step][key], rel), (step, key)
        assert two[step]["train/lr"] == one[step]["train/lr"]
    assert one[1]["train/grad_norm"] > cfg.optim.grad_clip  # clipping by the EP-aware norm
    assert abs(one[3]["rm/loss"] - one[1]["rm/loss"]) > 1e-6  # training moved the held-out scores
    for key in ("train/loss", "train/grad_norm", "rm/loss"):
        print(f"rm step 3 resumed at DP=1 {key}: {resumed[key]!r} vs dp1 {final[key]!r}")
        assert _close(resumed[key], final[key], 1e-5 if key == "train/grad_norm" else 1e-6), key


def test_rm_step_at_dp2_tp2_ep2_equals_dp1_and_its_state_reads_back_whole(moe, ray_cluster, tmp_path):
    """One packed rm step at DP=1 in this process and at DP=2 x TP=2 x EP=2 with sequence
    parallelism (4 ranks: each holds 2 of the 4 experts of each layer, half of each one's width;
    the reward head reads each row's last token from the gathered sequence; held-out pairs
    evaluated by every rank):

    - the training loss, accuracy, margin and gradient norm and the held-out accuracy and loss
      within 1e-6 of max(|value|, 1) (the bound of the rm step at TP=2,
      test_tensor_parallel_training.py);
    - every weight whose gradient AdamW's first step saturates (``|W1 - W0| >= 0.99 lr`` at DP=1:
      ``lr g / (|g| + eps)`` with ``|g| >= 99 eps``, eps 1e-8) within 1e-2 x lr. The others'
      first step divides the gradient's rounding by eps: at TP=2 alone they move as far (measured
      2.4e-4 at TP=2 x SP, DP=1), so they are counted, not bounded;
    - the train state the ranks write (each its expert and tensor shards), read back whole, is
      the model directory's weights bit for bit.

    Measured (fp32, CPU): loss equal (0.6918356), gradient norm 1.5e-8 apart (0.1376805),
    held-out loss 7.5e-7; saturated weights at most 4.6e-8 apart; 125 of the 68,651 others
    beyond 1e-6 (at most 2.8e-4, the attention output projections)."""
    from engine.backends.select_rm import reward_trainer
    from engine.distributed.stage_group import run_stage
    from engine.storage.model_dir import load_model_dir
    from engine.storage.train_state import load_train_state
    from engine.training.reward_model import train_reward_model
    from tests.engine.distributed.test_expert_parallel import layout_name

    cfg = _rm_config(steps=1)
    lr = cfg.optim.lr
    data = dict(make_trainer=reward_trainer, base_model_dir=moe["model"], dataset_path=moe["preference"], seed=0)
    want = train_reward_model(**data, cfg=cfg, out_dir=tmp_path / "dp1", resume_dir=None)
    layout_cfg = cfg.model_copy(update={"parallel": EP2_TP2})
    args = dict(**data, cfg=layout_cfg, out_dir=tmp_path / "ep_tp", resume_dir=tmp_path / "resume")
    got = run_stage(train_reward_model, args, EP2_TP2, "rm")
    what = layout_name(EP2_TP2)
    for key in ("train/loss", "train/accuracy", "train/margin", "train/grad_norm", "rm/accuracy", "rm/loss"):
        print(f"rm step {key}: dp1 {want[key]!r} {what} {got[key]!r} (|diff| {abs(got[key] - want[key]):.3g})")
        assert _close(got[key], want[key]), key
    assert want["train/grad_norm"] > cfg.optim.grad_clip  # clipping by the layout's norm

    def weights(path: Path) -> dict[str, torch.Tensor]:
        loaded = load_model_dir(path)
        return {**loaded.model.state_dict(), **(loaded.heads or {})}

    start, a, b = weights(moe["model"]), weights(tmp_path / "dp1"), weights(tmp_path / "ep_tp")
    keys = [k for k, v in a.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert a.keys() == b.keys() and "reward_head.weight" in keys
    moved = torch.cat([((a[k].float() - start[k].float()) / lr).abs().flatten() for k in keys])
    diff = torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in keys])
    saturated = moved >= 0.99
    others = diff[~saturated]
    print(
        f"rm weights after one step, {what} vs DP=1: saturated {int(saturated.sum())} at most "
        f"{float(diff[saturated].max()):.3g} apart; {int((others > 1e-6).sum())} of the {others.numel()} "
        f"others beyond 1e-6 (at most {float(others.max()):.3g})"
    )
    assert int(saturated.sum()) > diff.numel() // 2  # most of the model took a full step
    assert float(diff[saturated].max()) < 1e-2 * lr

    state = load_train_state(tmp_path / "resume").model  # every rank's expert and tensor shards, gathered
    named = {k.removeprefix("gpt."): v for k, v in state.items()}
    assert set(keys) <= named.keys() and [k for k in keys if not torch.equal(named[k], b[k])] == []


def _state_weights(resume_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from engine.storage.train_state import load_train_state
    from engine.training.critic import critic_state_dir

    return {k: v for k, v in load_train_state(critic_state_dir(resume_dir, step)).model.items()}


@pytest.mark.parametrize("layout", [EP2, EP2_TP2], ids=["dp2-ep2", "dp2-tp2-ep2-sp"])
def test_critic_at_dp2_ep2_equals_dp1_even_and_uneven_micro_batches(moe, ray_cluster, tmp_path, layout):
    """The critic's values before, two value updates (batch A: 8 rows, 2 micro-batches per rank;
    batch B: 5 rows, 2 and 1, so rank 1 runs a padding forward in the value pass and a
    zero-weighted padding backward in the update), the values and every weight after them,
    against the plain DP=1 worker on the same trajectories.

    Measured (fp32, CPU): see docs/conversion.md, Expert parallelism (the RL critic)."""
    import ray

    from engine.algorithms.aggregation import global_norm
    from engine.backends.megatron.critic import CriticWorker
    from engine.distributed.group import WorkerGroup
    from engine.storage.train_state import DataPosition

    cfg = rl_config(micro_batch_size=2, parallel={"critic": layout})
    single = CriticWorker(moe["model"], cfg.model_copy(update={"parallel": RLParallelConfig()}), 3, 1)
    start = {k: v.detach().clone() for k, v in single.model.state_dict().items() if isinstance(v, torch.Tensor)}
    norm_fn = lambda t: global_norm(t.response_mask)  # noqa: E731
    group = WorkerGroup(CriticWorker, layout, {"num_cpus": 0}, (str(moe["model"]), cfg, 3, 1), seed=3, norm_fn=norm_fn)
    offsets = torch.tensor([0.3, -0.1, 0.25, -0.3, 0.05, -0.15, 0.22, -0.05])[:, None]  # none at the 0.2 clip edge
    try:
        ray.get(group.__ray_ready__.remote())
        base = trajectory()
        for name, traj in even_and_uneven_batches(cfg.micro_batch_size):
            values = single.compute_values(traj)
            got = ray.get(group.compute_values.remote(traj))
            diff = float((got - values).abs().max())
            print(f"batch {name}: critic values EP=2 vs EP=1 max |diff| {diff:.3g}")
            assert diff <= 1e-6 and float(values.abs().max()) > 1e-3  # real values, not zeros
            traj = traj.with_(values=(values + offsets[: len(traj)]) * traj.response_mask)
            want = single.update(traj)
            have = ray.get(group.update.remote(traj))
            for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
                print(f"batch {name} {key}: dp1 {want[key]!r} dp2 x ep2 {have[key]!r}")
                assert _close(have[key], want[key]), (name, key)
            assert want["critic/grad_norm"] > cfg.critic.optim.grad_clip  # clipping by the EP-aware norm
        after = single.compute_values(base)
        diff = float((ray.get(group.compute_values.remote(base)) - after).abs().max())
        print(f"critic values after both updates, EP=2 vs EP=1: max |diff| {diff:.3g}")
        assert diff <= 1e-6
        single.save_state(tmp_path / "dp1", 2, DataPosition(0, 8, 0), {})
        ray.get(group.save_state.remote(str(tmp_path / "ep2"), 2, DataPosition(0, 8, 0), {}))  # every rank's experts
    finally:
        group.kill()
    a, b = _state_weights(tmp_path / "dp1", 2), _state_weights(tmp_path / "ep2", 2)
    assert a.keys() == b.keys() and {"value_head.weight", "value_head.bias"} <= a.keys()
    experts = [k for k in a if ".experts." in k]
    assert len(experts) == 2 * 4 * 2 and all(float((a[k] - start[k]).abs().max()) > 1e-5 for k in experts)
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    print(f"critic weights after 2 updates: max |diff| {float(diff.max()):.3g}, {int((diff > 1e-6).sum())} > 1e-6")
    assert float(diff.max()) < 1e-2 * cfg.critic.optim.lr
    assert int((diff > 1e-6).sum()) <= 1e-4 * diff.numel()


@pytest.mark.parametrize("layout", [EP2, EP2_TP2], ids=["dp2-ep2", "dp2-tp2-ep2-sp"])
def test_reward_model_scores_at_ep2_equal_ep1(moe, ray_cluster, layout):
    """RL's reward-model scores of 21 responses at DP=2 x EP=2 against the plain worker: one
    long row balances twenty short ones (Karmarkar-Karp on tokens), so rank 0 scores 1 row in 1
    forward and rank 1 scores 20 in 2 (``score``'s 16 per forward): rank 0 runs a padding
    forward, and its first forward is padded from ``[1, T]`` to rank 1's 16 rows."""
    import ray

    from engine.distributed.group import WorkerGroup, shard_rows
    from engine.rl.reward_workers import RewardModelWorker
    from engine.rollout.base import RolloutOutput
    from engine.trajectory import Trajectory

    prompt_ids = [list(range(3, 43))] + [[5, 6]] * 20
    outs = [[RolloutOutput(tuple(range(3, 23)), (-1.0,) * 20, "stop")]] + [[RolloutOutput((7,), (-1.0,), "stop")]] * 20
    traj = Trajectory.from_rollout(prompt_ids, outs, pad_id=0)
    assert [len(s) for s in shard_rows((traj.prompt_lengths + traj.response_lengths).tolist(), 2)] == [1, 20]
    prompts = [[{"role": "user", "content": f"What is {i} + {2 * i}?"}] for i in range(21)]
    texts = ["The sum is " + " plus ".join(str(j) for j in range(30))] + [f"{3 * i}" for i in range(1, 21)]

    single = RewardModelWorker(moe["model"], 1, precision="fp32")
    want = single.score_responses(traj, prompts, texts)
    group = WorkerGroup(RewardModelWorker, layout, {"num_cpus": 0}, (str(moe["model"]), 1), {"precision": "fp32"})
    try:
        ray.get(group.__ray_ready__.remote())
        have = ray.get(group.score_responses.remote(traj, prompts, texts))
    finally:
        group.kill()
    diff = float((have - want).abs().max())
    print(
        f"reward-model scores EP=2 vs EP=1: max |diff| {diff:.3g} (scores {float(want.min()):.4f}..{float(want.max()):.4f})"
    )
    assert have.shape == want.shape == (21,)
    assert diff <= 1e-6 and float(want.std()) > 1e-4  # real, distinct scores
