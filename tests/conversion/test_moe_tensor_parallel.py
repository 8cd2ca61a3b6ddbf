"""MoE layers at tensor-parallel size 2 with sequence parallelism (2 gloo processes on CPU):
megatron's expert tensor parallelism as the oracle for the shard layouts, transformers' logits,
gradients equal to TP=1's, and exact merges and exports.

The tiny MoE models of tests/conversion/test_moe_conversion.py (Qwen3-MoE, Qwen3-MoE with a dense
layer and biases, Mixtral, Qwen2-MoE with a gated shared expert; 4 experts, top-2, expert width
48). Each TP rank holds half of every expert's width (``expert_tensor_parallel_size`` = 2,
megatron's default) and of the shared expert's; routers and the shared-expert gate are
replicated (conversion/tensor_parallel.py). Inputs of odd length 13: sequence parallelism pads
each forward to a multiple of 2.
"""

from __future__ import annotations

import pytest
import torch

from conversion import hf_to_megatron, megatron_to_hf
from conversion.spec import GPTSpec
from conversion.tensor_parallel import merge_shards, shard_state, split_of
from tests.conversion.test_moe_conversion import CASES, VOCAB, tiny_moe
from tests.conversion.test_tensor_parallel import assert_table_matches, run_cases

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

TOL = 1e-5


def test_moe_table_matches_megatrons_parameter_attributes():
    """Every parameter of a built MoE model (routed experts, shared expert, its gate, router) is
    split as megatron marks it (``partition_dim``, ``partition_stride``) or replicated."""
    from engine.models.megatron import build_gpt_model

    cfg, _, state = tiny_moe("qwen2_moe")
    model = build_gpt_model(GPTSpec.from_hf_config(cfg))
    params = dict(model.named_parameters())
    assert params.keys() == hf_to_megatron(cfg, state).keys()
    assert any(".local_experts.3.linear_fc1." in n for n in params) and "decoder.layers.0.mlp.router.weight" in params
    assert_table_matches(params)


def _moe_rank(rank: int, world: int, port: int, workdir: str, names: list[str]) -> None:
    """One TP rank (spawned) at TP=2 + SP: per case, megatron's own initialisation, then the
    rank's shard of the HF weights loaded: logits (eval), and the loss and gradients of a
    training forward with the sequence-parallel partial gradients summed over the group as the
    training step sums them (``all_reduce_tensor_parallel_partial_grads``)."""
    import torch.distributed as dist

    from engine.distributed.collectives import all_reduce_tensor_parallel_partial_grads
    from engine.models.megatron import build_gpt_model, gpt_logits, load_mcore_state, mcore_state
    from engine.models.platform import init_model_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        init_model_parallel(tp=world, sequence_parallel=True)
        for name in names:
            case = torch.load(f"{workdir}/{name}.pt", weights_only=True)
            spec, ids = GPTSpec.model_validate(case["spec"]), case["ids"]
            model = build_gpt_model(spec, seed=3)
            init = {k: v.clone() for k, v in mcore_state(model).items()}
            load_mcore_state(model, case["shards"][rank])
            model.eval()
            with torch.no_grad():
                logits = gpt_logits(model, ids)
            model.train()  # megatron's MoELayer trains at TP > 1 only under sequence parallelism
            loss = torch.nn.functional.cross_entropy(
                gpt_logits(model, ids)[:, :-1].reshape(-1, spec.vocab_size), ids[:, 1:].reshape(-1)
            )
            loss.backward()
            all_reduce_tensor_parallel_partial_grads(model)
            torch.save(
                {
                    "init": init,
                    "logits": logits,
                    "loss": loss.detach(),
                    "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
                    "loaded": {k: v.clone() for k, v in mcore_state(model).items()},
                    "marked": sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)),
                },
                f"{workdir}/{name}.rank{rank}.pt",
            )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def moe_tp2_runs(tmp_path_factory):
    """Per case: the HF config, model and checkpoint state, the input ids, the full megatron state
    and both ranks' outputs, from one spawn of 2 processes."""
    workdir = tmp_path_factory.mktemp("moe_tp2")
    cases = {}
    for name in CASES:
        cfg, hf, state = tiny_moe(name)
        spec = GPTSpec.from_hf_config(cfg)
        ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(11))
        full = hf_to_megatron(cfg, state)
        torch.save(
            {"spec": spec.model_dump(), "ids": ids, "shards": shard_state(spec, full, 2)}, workdir / f"{name}.pt"
        )
        cases[name] = (cfg, hf, state, spec, ids, full)
    return run_cases(workdir, cases, target=_moe_rank)


@pytest.mark.parametrize("name", list(CASES))
def test_moe_tp2_logits_match_transformers(moe_tp2_runs, name):
    """The TP=2 + SP logits of the HF weights (fp32) within 1e-5 of transformers', on both ranks alike."""
    cfg, hf, state, spec, ids, full, ranks = moe_tp2_runs[name]
    with torch.no_grad():
        ref = hf(ids).logits
    errs = [float((out["logits"] - ref).abs().max()) for out in ranks]
    print(
        f"MoE TP=2 + SP {name}: max |logit diff| vs transformers {max(errs):.3e} (logits up to {ref.abs().max():.2f})"
    )
    assert ranks[0]["logits"].shape == ref.shape == (2, 13, VOCAB)
    assert max(errs) < TOL and torch.equal(ranks[0]["logits"], ranks[1]["logits"])


@pytest.mark.parametrize("name", list(CASES))
def test_moe_tp2_shards_are_megatrons_and_export_bit_exact(moe_tp2_runs, name):
    """megatron's TP=2 initialisation from a seed is, on each rank, exactly ``shard_state``'s part
    of the TP=1 model from that seed (every expert's gate/up halves, the routers replicated); the
    loaded shards merge to the imported state and export to the HF checkpoint's tensors bit for bit."""
    from engine.models.megatron import build_gpt_model, mcore_state

    cfg, hf, state, spec, ids, full, ranks = moe_tp2_runs[name]
    expected = shard_state(spec, mcore_state(build_gpt_model(spec, seed=3)), 2)
    for r, out in enumerate(ranks):
        assert out["init"].keys() == expected[r].keys()
        assert [k for k, t in expected[r].items() if not torch.equal(out["init"][k], t)] == [], r
    merged = merge_shards(spec, [out["loaded"] for out in ranks])
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)
    exported = dict(megatron_to_hf(cfg, merged))
    want = {k: v for k, v in state.items() if not (spec.tie_word_embeddings and k == "lm_head.weight")}
    assert exported.keys() == want.keys()
    assert [k for k, t in exported.items() if not torch.equal(t, want[k])] == []


@pytest.mark.parametrize("name", list(CASES))
def test_moe_tp2_gradients_equal_tp1(moe_tp2_runs, name):
    """The training forward's loss and, merged over the ranks, its gradients equal TP=1's within
    1e-5: the router, norms and shared-expert gate (marked ``sequence_parallel``, each rank's
    gradient from its half of the sequence) summed over the group, the expert shards as they are."""
    from engine.models.megatron import build_gpt_model, gpt_logits, load_mcore_state

    cfg, hf, state, spec, ids, full, ranks = moe_tp2_runs[name]
    marked = ranks[0]["marked"]
    assert all(split_of(n) is None for n in marked)
    assert {n for n in marked if n.endswith("mlp.router.weight")} == {
        f"decoder.layers.{i}.mlp.router.weight" for i in range(spec.num_layers) if spec.is_moe_layer(i)
    }
    reference = build_gpt_model(spec, seed=3)
    load_mcore_state(reference, full)
    reference.train()
    loss = torch.nn.functional.cross_entropy(
        gpt_logits(reference, ids)[:, :-1].reshape(-1, spec.vocab_size), ids[:, 1:].reshape(-1)
    )
    loss.backward()
    assert abs(float(ranks[0]["loss"]) - float(loss)) < TOL and torch.equal(ranks[0]["loss"], ranks[1]["loss"])
    grads = merge_shards(spec, [out["grads"] for out in ranks])
    diffs = {k: float((grads[k] - p.grad).abs().max()) for k, p in reference.named_parameters()}
    worst = max(diffs, key=diffs.__getitem__)
    print(f"MoE TP=2 + SP {name}: max |grad diff| vs TP=1 {diffs[worst]:.3e} ({worst})")
    assert diffs[worst] < TOL
