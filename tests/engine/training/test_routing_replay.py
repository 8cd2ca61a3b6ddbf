"""MoE routing replay (rl.moe_routing_replay) on a tiny Qwen3-MoE GPTModel (2 layers, 4
experts, top-2), in process: the old-log-prob pass records each token's top-k of the router
logits (checked against an independent top-k), and the update's forward replays it, so moving
the router between the two passes does not change the routing: the policy ratio stays exactly
1 where the move flips experts, and is not 1 without replay."""

from __future__ import annotations

import pytest
import torch

import engine.training.actor as actor_module
from config.rl import KLConfig, RLConfig, RolloutConfig
from engine.models.routing_replay import RoutingReplay
from engine.rollout.base import RolloutOutput
from engine.training.actor import actor_update, compute_logprobs
from engine.trajectory import Trajectory
from tests.engine.training.test_moe_router import TOPK, build

CONSTANT = 17  # the token of the constant row: every position has the same hidden state


def trajectory() -> Trajectory:
    """Row 0: 4 prompt and 4 response tokens, all CONSTANT; rows 1-2: random tokens."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda n: tuple(torch.randint(3, 300, (n,), generator=gen).tolist())  # noqa: E731
    prompts = [[CONSTANT] * 4, list(rand(5)), list(rand(3))]
    responses = [(CONSTANT,) * 4, rand(6), rand(2)]
    outs = [[RolloutOutput(r, (-1.0,) * len(r), "stop")] for r in responses]
    traj = Trajectory.from_rollout(prompts, outs, pad_id=0)
    return traj.with_(advantages=torch.tensor([1.0, -1.0, 0.5])[:, None] * traj.response_mask)


def rl_cfg(**overrides) -> RLConfig:
    fields = dict(
        micro_batch_size=1,
        kl=KLConfig(coef=0.0),
        rollout=RolloutConfig(backend="hf", temperature=1.0),
        precision="fp32",
        moe_routing_replay=True,
    )
    return RLConfig(**(fields | overrides))


def router_hooks(model) -> tuple[list, list, list]:
    """Forward hooks keeping each router's input [S, B, H] and its routing map [tokens, E]
    (the experts each token went to), one list per router in model order."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    inputs, maps = [[] for _ in routers], [[] for _ in routers]
    for router, x_store, map_store in zip(routers, inputs, maps):

        def keep(mod, args, out, x_store=x_store, map_store=map_store):
            x_store.append(args[0].detach())
            map_store.append(out[1].detach())

        router.register_forward_hook(keep)
    return routers, inputs, maps


def as_map(indices: torch.Tensor, experts: int = 4) -> torch.Tensor:
    """[tokens, k] expert indices -> [tokens, E] bool routing map."""
    return torch.zeros(indices.size(0), experts, dtype=torch.bool).scatter(1, indices, True)


@pytest.mark.parametrize("packed", [False, True])
def test_recorded_indices_are_the_top_k_of_the_router_logits(packed):
    model = build(None)
    routing = RoutingReplay(model)
    routers, inputs, _ = router_hooks(model)
    traj = trajectory()
    compute_logprobs(model, traj, 1.0, micro_batch_size=2, packed=packed, routing=routing)
    groups = ([0, 1], [2])
    assert routing.rows == list(groups) and len(routing.recorded) == 2
    lengths = traj.prompt_lengths + traj.response_lengths  # [8, 11, 5]
    # tokens routed per micro-batch: padded, its widest row x its rows ([T, B] flattened); packed, its real tokens
    expected_tokens = [int(lengths[g].sum()) if packed else int(lengths[g].max()) * len(g) for g in groups]
    assert [rec[0].size(0) for rec in routing.recorded] == expected_tokens == ([19, 5] if packed else [22, 5])
    for mb, recorded in enumerate(routing.recorded):
        assert len(recorded) == len(routers) == 2
        for layer, (router, indices) in enumerate(zip(routers, recorded)):
            x = inputs[layer][mb]
            logits = x.reshape(-1, x.size(-1)).double() @ router.weight.detach().double().T  # [tokens, E]
            expected = torch.topk(logits, TOPK, dim=-1).indices
            assert torch.equal(indices.sort(-1).values, expected.sort(-1).values), (mb, layer)


def first_micro_batch_ratio(model, traj, cfg, routing, old, monkeypatch) -> tuple[torch.Tensor, dict]:
    """The update's forward of its first micro-batch, without an optimizer step: the policy
    ratio exp(new - old) on that micro-batch's loss tokens, and its loss metrics."""
    new, seen = [], []
    real = actor_module.response_logprobs

    def spy(*args, **kwargs):  # the real response_logprobs; keeps what the loss got
        out = real(*args, **kwargs)
        new.append(out[0].detach())
        return out

    def step(micro, loss_fn):
        model.train()
        seen.append(micro[0])
        seen.append(loss_fn(model, micro[0])[2])
        return {k: 0.0 for k in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy")}

    monkeypatch.setattr(actor_module, "response_logprobs", spy)
    actor_update(traj.with_(old_logprobs=old), cfg, 1.0, step, routing=routing)
    monkeypatch.setattr(actor_module, "response_logprobs", real)
    mb, metrics = seen
    return torch.exp(new[0] - mb.old_logprobs)[mb.response_mask > 0], metrics


def test_replay_keeps_the_ratio_at_one_after_the_router_moved(monkeypatch):
    model = build(None)
    routing = RoutingReplay(model)
    routers, inputs, _ = router_hooks(model)
    traj, cfg = trajectory(), rl_cfg()
    old = compute_logprobs(model, traj, 1.0, micro_batch_size=1, routing=routing)
    # Row 0 (the first micro-batch) has one hidden state at every position, so layer 0 sends all
    # its tokens to the same 2 experts. Move the router: an unused expert e gets expert a's row
    # plus 5 x / |x|^2, so its logit is a's + 5 for those tokens, and e replaces the lower one.
    first = routing.recorded[0][0]  # layer 0, micro-batch 0: [8 tokens, 2]
    assert first.shape == (8, 2) and torch.equal(first, first[:1].expand_as(first))
    a = int(first[0, 0])
    e = next(j for j in range(4) if j not in first[0].tolist())
    x = inputs[0][0].reshape(-1, inputs[0][0].size(-1))
    with torch.no_grad():
        routers[0].weight[e] = routers[0].weight[a] + 5 * x.mean(0) / x.mean(0).dot(x.mean(0))
    flipped = torch.topk(x @ routers[0].weight.detach().T, TOPK).indices
    assert (flipped == e).any(-1).all()  # without replay every token of row 0 now goes to e

    ratio, metrics = first_micro_batch_ratio(model, traj, cfg, routing, old, monkeypatch)
    assert ratio.numel() == 4 and torch.equal(ratio, torch.ones_like(ratio))  # bit for bit
    assert metrics["ppo_kl"] == 0.0 and metrics["pg_clipfrac"] == 0.0

    off = cfg.model_copy(update={"moe_routing_replay": False})
    ratio_off, metrics_off = first_micro_batch_ratio(model, traj, off, None, old, monkeypatch)
    spread = float((ratio_off - 1).abs().max())
    print(f"constructed flip: max |ratio - 1| on the first micro-batch: replay 0, no replay {spread:.4g}")
    assert spread > 1e-4 and metrics_off["ppo_kl"] != 0.0


def test_replay_under_a_random_router_move_routes_as_recorded(monkeypatch):
    """All rows in one micro-batch, every router moved by noise (0.5 x its weights' std): the
    update's forward routes every token exactly as recorded, where without replay some tokens
    flip; the ratio spread left with replay is the change of the replayed experts' gating weights."""
    model = build(None)
    routing = RoutingReplay(model)
    routers, _, maps = router_hooks(model)
    traj = trajectory()
    old = compute_logprobs(model, traj, 1.0, micro_batch_size=3, routing=routing)
    recorded = [as_map(i) for i in routing.recorded[0]]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for r in routers:
            r.weight.add_(0.5 * r.weight.std() * torch.randn(r.weight.shape, generator=gen))
    spreads, flips = {}, {}
    for replay in (True, False):
        cfg = rl_cfg(micro_batch_size=3, moe_routing_replay=replay)
        before = len(maps[0])
        ratio, _ = first_micro_batch_ratio(model, traj, cfg, routing if replay else None, old, monkeypatch)
        spreads[replay] = float((ratio - 1).abs().max())
        flips[replay] = sum(int((maps[layer][before] != recorded[layer]).any(-1).sum()) for layer in range(2))
    print(
        f"random router move: max |ratio - 1| replay {spreads[True]:.4g} (tokens flipped {flips[True]}), "
        f"no replay {spreads[False]:.4g} (tokens flipped {flips[False]} of {2 * recorded[0].size(0)})"
    )
    assert flips[True] == 0 and flips[False] > 0


def test_replay_refuses_other_micro_batches_a_missing_recording_and_a_dense_model():
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model

    model = build(None)
    routing = RoutingReplay(model)
    traj = trajectory()
    old = compute_logprobs(model, traj, 1.0, micro_batch_size=1, routing=routing)
    step = lambda micro, loss_fn: pytest.fail("the update must refuse before any forward")  # noqa: E731
    with pytest.raises(ValueError, match=r"micro-batches differ.*first at micro-batch 0; 2 vs 3"):
        actor_update(traj.with_(old_logprobs=old), rl_cfg(micro_batch_size=2), 1.0, step, routing=routing)
    with pytest.raises(ValueError, match="needs the old log-probs"):
        actor_update(traj, rl_cfg(), 1.0, step, routing=routing)
    routing.clear()
    with pytest.raises(ValueError, match="no recorded routing"):
        actor_update(traj.with_(old_logprobs=old), rl_cfg(), 1.0, step, routing=routing)
    with pytest.raises(ValueError, match="MoE layer 0 routes 5 tokens, the recorded routing has 9"):
        with routing.replaying([torch.zeros(9, 2, dtype=torch.long)] * 2):
            compute_logprobs(model, traj.select(torch.tensor([2])), 1.0, micro_batch_size=1)
    dense = build_gpt_model(
        GPTSpec(
            architecture="qwen2",
            vocab_size=300,
            hidden_size=64,
            num_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            ffn_hidden_size=64,
            max_position_embeddings=64,
            rope_theta=1e4,
            norm_epsilon=1e-6,
            add_qkv_bias=True,
            tie_word_embeddings=True,
        ),
        seed=0,
    )
    with pytest.raises(ValueError, match="no MoE layer"):
        RoutingReplay(dense)
    with pytest.raises(ValueError, match="rl.moe_routing_replay needs rl.backend: megatron"):
        rl_cfg(backend="deepspeed")
    assert rl_cfg().precomputes_old_logprobs and not rl_cfg(moe_routing_replay=False).precomputes_old_logprobs
