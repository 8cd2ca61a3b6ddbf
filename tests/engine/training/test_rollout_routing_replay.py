"""Rollout routing replay (R3, rl.moe_routing_replay: rollout) on a tiny Qwen3-MoE (2 layers, 4
experts, top-2): the HF rollout engine returns each prompt and response token's experts (checked
against a full transformers forward with output_router_logits), the trajectory keeps them through
select/cat and the rollout dump, and the megatron trainer replays them in the old-log-prob pass
and the update, token by token, even where its own router would choose otherwise."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from config.rl import RLConfig, RolloutConfig
from config.rl_engine import EngineConfig
from conversion import megatron_to_hf
from conversion.export import write_hf_safetensors
from conversion.spec import GPTSpec
from engine.models.megatron import mcore_state
from engine.models.routing_replay import RoutingReplay, rollout_indices
from engine.rl.rollout_dump import read_step, write_step
from engine.rollout.base import RolloutOutput, SamplingSpec
from engine.rollout.hf_rollout import HFRollout
from engine.training.actor import compute_logprobs
from engine.trajectory import Trajectory
from tests.engine.training.test_moe_router import TOPK, build, moe_config
from tests.engine.training.test_routing_replay import as_map, first_micro_batch_ratio, rl_cfg, router_hooks

PROMPTS = [[5, 6, 7, 8], [9, 9], [123, 4, 77]]
EOS = tuple(range(2, 300, 5))  # every fifth token ends a response: responses of several lengths
SPEC = SamplingSpec(n=2, temperature=1.0, max_new_tokens=6, seed=3, return_routed_experts=True)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """The HF rollout engine serving the seed-0 megatron model of ``build`` (same weights), and
    its outputs for PROMPTS with routed experts."""
    hf_config = {**GPTSpec.from_hf_config(moe_config()).to_hf_config(), "eos_token_id": 2, "pad_token_id": 0}
    out = tmp_path_factory.mktemp("r3") / "hf"
    write_hf_safetensors(out, hf_config, megatron_to_hf(hf_config, mcore_state(build(None))), None)
    engine = HFRollout(out, eos_token_ids=EOS, max_batch_size=4)  # two chunks of the 6 sequences
    return engine, engine.generate(PROMPTS, SPEC)


def trajectory(outputs) -> Trajectory:
    traj = Trajectory.from_rollout(PROMPTS, outputs, pad_id=0)
    return traj.with_(advantages=torch.linspace(-1, 1, len(traj))[:, None] * traj.response_mask)


def test_hf_rollout_experts_equal_a_full_forward_top_k(rollout):
    engine, outputs = rollout
    lengths = sorted({len(o.token_ids) for group in outputs for o in group})
    assert len(lengths) > 1  # some responses stopped early: left padding and finished rows are covered
    for prompt, group in zip(PROMPTS, outputs):
        for out in group:
            ids = torch.tensor([prompt + list(out.token_ids)])
            with torch.no_grad():
                logits = engine.model(ids, output_router_logits=True).router_logits  # per MoE layer [T, E]
            expected = torch.stack([torch.topk(torch.softmax(x.float(), -1), TOPK).indices for x in logits], dim=1)
            routed = out.routed_experts
            assert routed is not None and routed.dtype == torch.int16 and routed.shape == (ids.size(1), 2, TOPK)
            assert torch.equal(routed.long(), expected)  # the same experts in torch.topk's order
    plain = engine.generate(PROMPTS, SamplingSpec(n=2, temperature=1.0, max_new_tokens=6, seed=3))
    assert plain == outputs and all(o.routed_experts is None for g in plain for o in g)  # same samples


def _full_forward_top_k(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), moe_layers, k]``: each token's top-k experts in a full forward of ``ids``."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits  # per MoE layer [T, E]
    return torch.stack([torch.topk(torch.softmax(x.float(), -1), TOPK).indices for x in logits], dim=1)


def test_partial_rollouts_keep_each_tokens_first_routing(rollout):
    """R3 with partial rollouts (``generate_in_chunks``, 2 tokens per chunk, up to 6): a weight
    update (noise on every gate, through the engine's ``update_weights``) lands after each chunk.
    A continued chunk routes the prompt and the tokens so far again under the new weights; each
    token keeps the routing of the chunk that routed it first. So the rows of the prompt and of
    chunk 0's tokens are the top-k of a full forward under the first weights, chunk 1's under the
    second, chunk 2's under the third; the updates move enough routing that any other choice of
    rows would differ."""
    from engine.rollout.partial import WeightGate, generate_in_chunks

    engine, _ = rollout
    gates = [name for name, _ in engine.model.named_parameters() if name.endswith("mlp.gate.weight")]
    original = {name: p.detach().clone() for name, p in engine.model.named_parameters() if name in gates}
    noise = torch.Generator().manual_seed(7)
    versions = [original]  # the gate weights each chunk runs under
    for _ in range(2):
        versions.append({n: w + 0.5 * torch.randn(w.shape, generator=noise) for n, w in original.items()})

    class UpdateAfterEachChunk:
        """The engine itself; after each chunk's generate, the next version's gates go in."""

        def __init__(self):
            self.chunks = 0

        def generate(self, prompts, sampling):
            outputs = engine.generate(prompts, sampling)
            self.chunks += 1
            if self.chunks < len(versions):
                engine.update_weights(versions[self.chunks].items())
            return outputs

    wrapped = UpdateAfterEachChunk()
    try:
        got = generate_in_chunks(wrapped, PROMPTS, SPEC, chunk_tokens=2, gate=WeightGate())
        expected = []  # per version, per sample: the full forward's top-k
        for version in versions:
            engine.update_weights(version.items())
            expected.append(
                [
                    [_full_forward_top_k(engine.model, p + list(o.token_ids)) for o in g]
                    for p, g in zip(PROMPTS, got.outputs)
                ]
            )
    finally:
        engine.update_weights(original.items())
    assert wrapped.chunks == 3
    rows_differ = 0
    for i, (prompt, group) in enumerate(zip(PROMPTS, got.outputs)):
        for j, out in enumerate(group):
            routed = out.routed_experts
            assert routed is not None and routed.shape == (len(prompt) + len(out.token_ids), 2, TOPK)
            for row in range(routed.size(0)):
                chunk = max(0, row - len(prompt)) // 2  # the chunk that routed it first
                assert torch.equal(routed[row].long(), expected[chunk][i][j][row]), (i, j, row)
                rows_differ += any(not torch.equal(routed[row].long(), e[i][j][row]) for e in expected)
    assert rows_differ > 10  # the versions route many tokens differently


def test_trajectory_keeps_the_experts_through_select_cat_and_the_dump(rollout, tmp_path):
    traj = trajectory(rollout[1])
    routed = traj.routed_experts
    assert routed is not None and routed.shape == (6, traj.input_ids.size(1), 2, TOPK)
    for b, out in enumerate(o for g in rollout[1] for o in g):
        n = out.routed_experts.size(0)
        assert torch.equal(routed[b, :n], out.routed_experts) and not routed[b, n:].any()
    picked = traj.select(torch.tensor([5, 0]))
    assert picked.routed_experts.shape[1] == picked.input_ids.size(1)
    assert torch.equal(picked.routed_experts, routed[[5, 0], : picked.input_ids.size(1)])
    short = traj.select(torch.tensor([2]))
    joined = Trajectory.cat([short, traj])
    assert torch.equal(joined.routed_experts[1:], routed)
    width = short.input_ids.size(1)
    assert torch.equal(joined.routed_experts[0, :width], short.routed_experts[0])
    assert not joined.routed_experts[0, width:].any()
    back = read_step(write_step(tmp_path, traj, {"step": 1})).traj
    assert back.routed_experts.dtype == torch.int16 and torch.equal(back.routed_experts, routed)


def real_tokens(mb: Trajectory, packed: bool) -> torch.Tensor:
    """BoolTensor ``[tokens]``: which of a micro-batch's routed tokens (megatron's order) are real."""
    lengths = mb.prompt_lengths + mb.response_lengths
    if packed:
        return torch.ones(int(lengths.sum()), dtype=torch.bool)
    return (torch.arange(mb.input_ids.size(1))[None, :] < lengths[:, None]).T.reshape(-1)


def flip_expert(router, x: torch.Tensor, replayed: torch.Tensor, real: torch.Tensor) -> int:
    """Move one expert ``e``'s router row by ``v`` solving ``x_t . v = 0`` on the real tokens that
    were sent to ``e`` and ``x_t . v = (their lowest chosen logit - e's logit) + 1`` on the others
    (least squares, exact while the tokens are at most the hidden size), so ``e`` wins a place for
    every real token that did not pick it and the logits of those that did stay (up to rounding).
    Returns ``e``."""
    x = x.reshape(-1, x.size(-1))[real].double()  # [n, H]
    chosen = replayed[real]  # [n, k]
    logits = x @ router.weight.detach().double().T  # [n, E]
    e = 0
    picked = (chosen == e).any(-1)
    target = torch.where(picked, 0.0, logits.gather(1, chosen).min(-1).values - logits[:, e] + 1.0)
    v = torch.linalg.lstsq(x, target[:, None]).solution[:, 0]
    assert torch.allclose(x @ v, target, atol=1e-8)
    with torch.no_grad():
        router.weight[e] += v.float()
    return e


@pytest.mark.parametrize("packed", [False, True])
def test_trainer_routes_as_the_rollout_in_both_passes(rollout, packed, monkeypatch):
    """The trainer's routers are moved off the rollout's (noise: a stand-in for a trainer/sampler
    mismatch), so their own top-k differs for some tokens; with rollout replay the old-log-prob pass
    and the update route every token as the rollout did, and the old log-probs are nearer the
    rollout's. A second move (:func:`flip_expert`) sends every token of the first micro-batch to
    another expert; with replay the ratio stays 1 (up to the rounding of the moved row)."""
    traj = trajectory(rollout[1])
    model = build(None)
    routing = RoutingReplay(model, "rollout")
    routers, inputs, maps = router_hooks(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for r in routers:
            r.weight.add_(0.2 * r.weight.std() * torch.randn(r.weight.shape, generator=gen))
    cfg = rl_cfg(micro_batch_size=4, packing=packed, moe_routing_replay="rollout")
    own = compute_logprobs(model, traj, 1.0, 4, packed=packed)  # no replay (true records these): own routing
    n_maps = len(maps[0])
    old = compute_logprobs(model, traj, 1.0, 4, packed=packed, routing=routing)
    micro = [traj.select(r) for r in (torch.arange(4), torch.arange(4, 6))]
    expected = [rollout_indices(m.routed_experts, m.prompt_lengths + m.response_lengths, packed) for m in micro]
    flips = 0
    for mb in range(2):
        for layer in range(2):
            replayed = maps[layer][n_maps + mb]
            assert torch.equal(replayed, as_map(expected[mb][layer])), (mb, layer)
            own_map = maps[layer][mb]  # the pass without replay above
            flips += int((own_map != replayed).any(-1)[real_tokens(micro[mb], packed)].sum())
    mask = traj.response_mask > 0
    mismatch = {name: float((lp - traj.rollout_logprobs)[mask].abs().max()) for name, lp in (("r3", old), ("own", own))}
    print(f"trainer vs rollout log-probs, max |diff|: {mismatch} ({flips} (token, layer) routings flipped)")
    assert flips > 0 and mismatch["r3"] < mismatch["own"]

    real = real_tokens(micro[0], packed)
    e = flip_expert(routers[0], inputs[0][n_maps], expected[0][0], real)
    before = len(maps[0])
    ratio, metrics = first_micro_batch_ratio(model, traj, cfg, routing, old, monkeypatch)
    for layer in range(2):
        assert torch.equal(maps[layer][before], as_map(expected[0][layer]))
    off = cfg.model_copy(update={"moe_routing_replay": False})
    ratio_off, _ = first_micro_batch_ratio(model, traj, off, None, old, monkeypatch)
    moved = maps[0][-1][real]  # layer 0's routing without replay
    assert bool(moved[:, e][~(expected[0][0][real] == e).any(-1)].all())  # e won every token that lacked it
    spread, spread_off = float((ratio - 1).abs().max()), float((ratio_off - 1).abs().max())
    print(f"constructed flip after rollout replay: max |ratio - 1| replay {spread:.3g}, no replay {spread_off:.3g}")
    assert spread < 1e-5 < 1e-3 < spread_off and abs(metrics["ppo_kl"]) < 1e-6


@pytest.fixture(scope="module")
def multi_turn(tmp_path_factory):
    """The seed-0 tiny Qwen3-MoE over a 280-token chat tokenizer, served by the HF engine that
    stops a turn at half the vocabulary (turns of ~2 tokens), and a 3-turn rollout of 2 prompts ×
    2 samples against the counter environment, with routed experts."""
    from data.chat import encode_prompt
    from engine.rollout.multi_turn import multi_turn_rollout
    from tests.engine import multi_turn_env_example as example
    from tests.engine.rollout.test_multi_turn import STOP_IDS, chat_tokenizer

    root = tmp_path_factory.mktemp("r3_multi_turn")
    tok = chat_tokenizer(root / "tokenizer")
    hf_config = {
        **GPTSpec.from_hf_config(moe_config(len(tok))).to_hf_config(),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    write_hf_safetensors(root / "hf", hf_config, megatron_to_hf(hf_config, mcore_state(build(None, len(tok)))), None)
    engine = HFRollout(root / "hf", eos_token_ids=(tok.eos_token_id, *STOP_IDS), max_batch_size=4)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "label": "e"} for a, b in ((1, 2), (3, 4))]
    prompts = [encode_prompt(tok, r["prompt"]) for r in rows]

    def run(make_env, budget: int, routed: bool):
        spec = SamplingSpec(n=2, temperature=1.0, max_new_tokens=budget, seed=5, return_routed_experts=routed)
        return multi_turn_rollout(engine, tok, prompts, rows, make_env, spec, max_turns=3)

    return {
        "engine": engine,
        "prompts": prompts,
        "pad": tok.pad_token_id,
        "run": run,
        "samples": run(example.make_counter_env, 24, True),
        "cut": run(example.make_long_observation_env, 5, True),
    }


def test_multi_turn_experts_are_each_tokens_first_routing(multi_turn):
    """Each policy token keeps the experts of the turn that sampled it, each observation token those
    of the next turn's prefill: every routed token's experts equal the top-k of a full transformers
    forward over the final sequence. An episode the budget closes right after an observation has no
    routing for those last tokens; the batch holds 0 there, as on padding."""
    from tests.engine import multi_turn_env_example as example

    engine, prompts = multi_turn["engine"], multi_turn["prompts"]
    tails = 0
    for name in ("samples", "cut"):
        for prompt, group in zip(prompts, multi_turn[name]):
            for smp in group:
                ids = torch.tensor([prompt + list(smp.token_ids)])
                with torch.no_grad():
                    logits = engine.model(ids, output_router_logits=True).router_logits
                expected = torch.stack([torch.topk(torch.softmax(x.float(), -1), TOPK).indices for x in logits], dim=1)
                routed = smp.routed_experts
                assert routed is not None and routed.dtype == torch.int16 and routed.shape[1:] == (2, TOPK)
                tail = ids.size(1) - routed.size(0)  # the last observation tokens no turn saw
                assert tail == 0 or (smp.finish_reason == "length" and not any(smp.loss_mask[-tail:])), (name, tail)
                tails += tail > 0
                assert torch.equal(routed.long(), expected[: routed.size(0)])
    turns = [s.num_turns for g in multi_turn["samples"] for s in g]
    assert max(turns) >= 2 and tails > 0  # observations inside the context, and a cut one at the end
    plain = multi_turn["run"](example.make_counter_env, 24, False)
    assert plain == multi_turn["samples"] and all(s.routed_experts is None for g in plain for s in g)
    traj = Trajectory.from_multi_turn(prompts, multi_turn["cut"], multi_turn["pad"])
    for b, smp in enumerate(s for g in multi_turn["cut"] for s in g):
        n = smp.routed_experts.size(0)
        assert torch.equal(traj.routed_experts[b, :n], smp.routed_experts) and not traj.routed_experts[b, n:].any()


def test_trainer_replays_a_multi_turn_rollouts_routing(multi_turn):
    """The old-log-prob pass over a multi-turn batch (policy and observation tokens) replays the
    rollout's experts for every routed token; with the trainer's routers moved, its log-probs on the
    policy tokens stay nearer the rollout's than with its own routing."""
    traj = Trajectory.from_multi_turn(multi_turn["prompts"], multi_turn["samples"], multi_turn["pad"])
    model = build(None, 280)
    routers, _, maps = router_hooks(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for r in routers:
            r.weight.add_(0.2 * r.weight.std() * torch.randn(r.weight.shape, generator=gen))
    own = compute_logprobs(model, traj, 1.0, 4)
    n_maps = len(maps[0])
    old = compute_logprobs(model, traj, 1.0, 4, routing=RoutingReplay(model, "rollout"))
    lengths = traj.prompt_lengths + traj.response_lengths
    expected = rollout_indices(traj.routed_experts, lengths, False)
    for layer in range(2):
        assert torch.equal(maps[layer][n_maps], as_map(expected[layer])), layer
    mask = traj.response_mask > 0
    diff = {k: float((lp - traj.rollout_logprobs)[mask].abs().max()) for k, lp in (("r3", old), ("own", own))}
    print(f"multi-turn, trainer vs rollout log-probs on policy tokens, max |diff|: {diff}")
    assert diff["r3"] < 1e-3 and diff["r3"] < diff["own"]


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match=r"rl.moe_routing_replay: rollout needs rl.rollout.backend: hf"):
        RLConfig(moe_routing_replay="rollout")
    multi = rl_cfg(moe_routing_replay="rollout", environment="tests.engine.multi_turn_env_example:make_counter_env")
    assert multi.replays_rollout_routing
    partial = EngineConfig(placement="disaggregated", off_policy_steps=1, partial_rollout_chunk_tokens=2)
    assert rl_cfg(moe_routing_replay="rollout", engine=partial).replays_rollout_routing  # partial rollouts too
    with pytest.raises(ValueError, match="rl.moe_routing_replay needs rl.backend: megatron"):
        rl_cfg(moe_routing_replay="rollout", backend="deepspeed")
    cfg = rl_cfg(moe_routing_replay="rollout")
    assert cfg.replays_rollout_routing and cfg.precomputes_old_logprobs and not rl_cfg().replays_rollout_routing
    assert RLConfig(rollout=RolloutConfig(backend="hf"), moe_routing_replay=True).moe_routing_replay is True
    dense = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=1, intermediate_size=32)
    )
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="Qwen2ForCausalLM has no top-k MoE gate"):
        HFRollout(tmp_path / "dense", eos_token_ids=[1]).generate([[3]], SPEC)
    model = build(None)
    bare = Trajectory.from_rollout(PROMPTS[:1], [[RolloutOutput((3, 4), (-1.0, -1.0), "length")]], 0)
    with pytest.raises(ValueError, match="the trajectory has no routed_experts"):
        compute_logprobs(model, bare, 1.0, 4, routing=RoutingReplay(model, "rollout"))
    three_layers = bare.with_(routed_experts=torch.zeros(1, 5, 3, TOPK, dtype=torch.int16))
    with pytest.raises(ValueError, match="have 3 MoE layers .* the policy has 2 MoE layers of 4 experts"):
        compute_logprobs(model, three_layers, 1.0, 4, routing=RoutingReplay(model, "rollout"))
