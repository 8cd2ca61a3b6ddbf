"""Tensor-parallel shards of megatron-core states: exact layouts, exact merges, and a real
TP=2 GPTModel (2 gloo processes on CPU) giving transformers' logits.

Needs megatron-core and transformers; the distributed test spawns 2 processes (~30 s here).
"""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from conversion import ConversionError, hf_to_megatron, megatron_to_hf
from conversion.layout import split_gate_up, split_qkv
from conversion.spec import GPTSpec
from conversion.tensor_parallel import merge_shards, shard_state, split_of
from tests.numerics import hf_logits_reference

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

TOL = 1e-5
CLASSES = {
    "llama": (LlamaForCausalLM, LlamaConfig),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config),
}


def tiny_hf(arch: str, tied: bool, vocab: int = 128, kv_heads: int = 2, **extra):
    """A random tiny HF model (hidden 64, 4 query heads, GQA with 2 KV heads, 2 layers, eager
    attention); Qwen3 with head_dim 32 != 64 / 4. Norms and biases are randomised too (HF starts
    them at one and zero), so a misplaced replica or bias slice shows in the logits."""
    cls, cfg_cls = CLASSES[arch]
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        initializer_range=0.1,
        **extra,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    torch.manual_seed(0)
    model = cls(cfg_cls(**kwargs)).eval()
    model.set_attn_implementation("eager")  # computes like megatron's local DotProductAttention
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return {**model.config.to_dict(), "architectures": [cls.__name__]}, model


def full_state(arch: str, tied: bool, **extra):
    cfg, model = tiny_hf(arch, tied, **extra)
    return GPTSpec.from_hf_config(cfg), hf_to_megatron(cfg, model.state_dict())


CASES = [
    ("llama", True, {}),
    ("llama", False, {}),
    ("qwen2", True, {}),
    ("qwen2", False, {}),
    ("qwen3", True, {}),
    ("qwen3", False, {}),
    ("qwen3", False, {"attention_bias": True}),
]
CASE_IDS = [
    "llama-tied",
    "llama-untied",
    "qwen2-tied",
    "qwen2-untied",
    "qwen3-tied",
    "qwen3-untied",
    "qwen3-attention-bias",
]


# ---- pure: shard and merge ------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "tied", "extra"), CASES, ids=CASE_IDS)
def test_merge_of_shards_is_bit_identical(arch, tied, extra):
    spec, full = full_state(arch, tied, **extra)
    for tp in (1, 2):
        shards = shard_state(spec, full, tp)
        assert len(shards) == tp and all(s.keys() == full.keys() for s in shards)
        merged = merge_shards(spec, shards)
        assert merged.keys() == full.keys()
        for name, t in full.items():
            assert merged[name].dtype == t.dtype and torch.equal(merged[name], t), name


@pytest.mark.parametrize(("arch", "tied", "extra"), CASES, ids=CASE_IDS)
def test_tp2_shards_hold_the_ranks_heads_rows_and_gate_up_halves(arch, tied, extra):
    """Each shard against an independent reading of megatron's layouts: vocab rows split in
    two; rank r has query group r (its 2 query heads, key head r, value head r); rank r's
    linear_fc1 is [gate_r; up_r], not a contiguous half of [gate; up]; row-parallel weights
    split by columns; norms and the o_proj bias whole."""
    spec, full = full_state(arch, tied, **extra)
    shards = shard_state(spec, full, 2)
    heads, groups, d, f = spec.num_attention_heads, spec.num_key_value_heads, spec.kv_channels, spec.ffn_hidden_size
    for r, shard in enumerate(shards):
        vocab_rows = slice(r * spec.vocab_size // 2, (r + 1) * spec.vocab_size // 2)
        for name in ("embedding.word_embeddings.weight",) + (() if tied else ("output_layer.weight",)):
            assert torch.equal(shard[name], full[name][vocab_rows])
        for i in range(spec.num_layers):
            p = f"decoder.layers.{i}."
            kinds = ("weight", "bias") if spec.add_qkv_bias else ("weight",)
            for kind in kinds:
                q, k, vv = split_qkv(full[f"{p}self_attention.linear_qkv.{kind}"], heads, groups, d)
                q_r, k_r, v_r = split_qkv(shard[f"{p}self_attention.linear_qkv.{kind}"], heads // 2, groups // 2, d)
                hq, hk = heads // 2 * d, groups // 2 * d
                assert torch.equal(q_r, q[r * hq : (r + 1) * hq]) and torch.equal(k_r, k[r * hk : (r + 1) * hk])
                assert torch.equal(v_r, vv[r * hk : (r + 1) * hk])
            gate, up = split_gate_up(full[p + "mlp.linear_fc1.weight"])
            fc1_r = shard[p + "mlp.linear_fc1.weight"]
            assert fc1_r.shape == (f, spec.hidden_size)
            ffn = slice(r * f // 2, (r + 1) * f // 2)
            assert torch.equal(fc1_r, torch.cat([gate[ffn], up[ffn]]))
            assert torch.equal(shard[p + "mlp.linear_fc2.weight"], full[p + "mlp.linear_fc2.weight"][:, ffn])
            cols = heads * d // 2
            assert torch.equal(
                shard[p + "self_attention.linear_proj.weight"],
                full[p + "self_attention.linear_proj.weight"][:, r * cols : (r + 1) * cols],
            )
            for name in (
                "input_layernorm.weight",
                "pre_mlp_layernorm.weight",
                "self_attention.q_layernorm.weight",
                "self_attention.k_layernorm.weight",
                "self_attention.linear_proj.bias",
            ):
                if p + name in full:
                    assert shard[p + name] is full[p + name]
        assert shard["decoder.final_layernorm.weight"] is full["decoder.final_layernorm.weight"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_indivisible_vocab_names_the_tensor(tied):
    spec, full = full_state("qwen2", tied, vocab=129)
    with pytest.raises(ConversionError, match=r"'embedding\.word_embeddings\.weight': vocabulary rows 129 .*size 2"):
        shard_state(spec, full, 2)
    if not tied:  # the output layer is checked on its own too
        ok = {**full, "embedding.word_embeddings.weight": full["embedding.word_embeddings.weight"][:128]}
        with pytest.raises(ConversionError, match=r"'output_layer\.weight': vocabulary rows 129"):
            shard_state(spec, ok, 2)


def test_indivisible_query_groups_and_ffn_name_the_field():
    spec, full = full_state("llama", False, kv_heads=1)
    with pytest.raises(ConversionError, match=r"num_key_value_heads=1 \(megatron num_query_groups\) .*size 2"):
        shard_state(spec, full, 2)
    spec, full = full_state("qwen3", True)
    with pytest.raises(ConversionError, match=r"num_key_value_heads=2 .* size 4"):
        shard_state(spec, full, 4)
    odd = spec.model_copy(update={"ffn_hidden_size": 95})
    with pytest.raises(ConversionError, match=r"ffn_hidden_size=95 .* size 2"):
        shard_state(odd, full, 2)
    with pytest.raises(ValueError, match="integer >= 1, got 0"):
        shard_state(spec, full, 0)


def test_bad_states_and_shards_are_named():
    spec, full = full_state("qwen3", False)
    with pytest.raises(ConversionError, match=r"missing tensor 'decoder\.layers\.0\.self_attention\.q_layernorm"):
        shard_state(spec, {k: v for k, v in full.items() if "q_layernorm" not in k}, 2)
    with pytest.raises(ConversionError, match=r"unexpected tensor 'decoder\.layers\.0\.mlp\.linear_fc1\.bias'"):
        shard_state(spec, {**full, "decoder.layers.0.mlp.linear_fc1.bias": torch.zeros(192)}, 2)
    shards = shard_state(spec, full, 2)
    norm = "decoder.layers.1.pre_mlp_layernorm.weight"
    bad = {**shards[1], norm: torch.zeros(64)}
    with pytest.raises(ConversionError, match=rf"replicated tensor '{norm}' differs between rank 0 and rank 1"):
        merge_shards(spec, [shards[0], bad])
    short = {k: v for k, v in shards[1].items() if k != "output_layer.weight"}
    with pytest.raises(ConversionError, match=r"rank 1: missing tensor 'output_layer\.weight'"):
        merge_shards(spec, [shards[0], short])
    with pytest.raises(ConversionError, match="no shards"):
        merge_shards(spec, [])
    # the grouped-GEMM experts' name (megatron's TEGroupedMLP), which the local spec does not build
    with pytest.raises(
        ConversionError, match=r"unknown megatron tensor 'decoder\.layers\.0\.mlp\.experts\.linear_fc1\.weight0'"
    ):
        split_of("decoder.layers.0.mlp.experts.linear_fc1.weight0")


@pytest.mark.parametrize(
    ("arch", "tied", "extra"),
    [("llama", True, {}), ("qwen3", False, {"attention_bias": True})],
    ids=["llama-tied", "qwen3-untied-bias"],
)
def test_table_matches_megatrons_parameter_attributes(arch, tied, extra):
    """megatron marks each parameter with tensor_model_parallel / partition_dim /
    partition_stride (tensor_parallel.layers.set_tensor_model_parallel_attributes); our table
    must say the same for every parameter, including Qwen3's q/k norms and o_proj bias."""
    from engine.models.megatron import build_gpt_model

    cfg, hf = tiny_hf(arch, tied, **extra)
    model = build_gpt_model(GPTSpec.from_hf_config(cfg))
    params = dict(model.named_parameters())
    assert params.keys() == hf_to_megatron(cfg, hf.state_dict()).keys()  # every tensor we shard is checked
    assert_table_matches(params)


def assert_table_matches(params: dict[str, torch.nn.Parameter]) -> None:
    """Each parameter split as megatron marks it (``partition_dim``, ``partition_stride``), or
    replicated where megatron marks nothing."""
    for name, p in params.items():
        split = split_of(name)
        if getattr(p, "tensor_model_parallel", False):
            assert split is not None and (split.dim, split.stride) == (p.partition_dim, p.partition_stride), name
        else:
            assert split is None, name


# ---- real distributed: a TP=2 GPTModel in 2 gloo processes ------------------------------------

TP_CASES = {  # name -> (arch, tied, extra); every family, tied and untied, GQA, all bias kinds
    "llama": ("llama", False, {}),
    "qwen2": ("qwen2", True, {}),
    "qwen3": ("qwen3", True, {}),
    "qwen3-attention-bias": ("qwen3", False, {"attention_bias": True}),
    "stories260K": None,  # the real pretrained Llama (GGUF fixture): 8 heads, 4 KV heads, head_dim 8
}
TP_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_rank(rank: int, world: int, port: int, workdir: str, names: list[str]) -> None:
    """One TP rank (spawned): builds the TP=2 GPTModel per case, records megatron's own
    initialisation, loads its shard, and saves logits, gradients and the loaded state."""
    import torch.distributed as dist

    from engine.models.megatron import build_gpt_model, gpt_logits, load_mcore_state, mcore_state
    from engine.models.platform import init_model_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        init_model_parallel(tp=world)
        for name in names:
            case = torch.load(f"{workdir}/{name}.pt", weights_only=True)
            spec = GPTSpec.model_validate(case["spec"])
            model = build_gpt_model(spec, seed=3)
            init = {k: v.clone() for k, v in mcore_state(model).items()}
            load_mcore_state(model, case["shards"][rank])
            model.eval()
            with torch.no_grad():
                logits = gpt_logits(model, case["ids"])
            ids = case["ids"]
            loss = torch.nn.functional.cross_entropy(
                gpt_logits(model, ids)[:, :-1].reshape(-1, spec.vocab_size), ids[:, 1:].reshape(-1)
            )
            loss.backward()
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            torch.save(
                {
                    "init": init,
                    "logits": logits,
                    "loss": loss.detach(),
                    "grads": grads,
                    "loaded": {k: v.clone() for k, v in mcore_state(model).items()},
                },
                f"{workdir}/{name}.rank{rank}.pt",
            )
    finally:
        dist.destroy_process_group()


def _run_ranks(world: int, workdir: str, names: list[str], target=None) -> None:
    """Spawn ``world`` processes of ``target(rank, world, port, workdir, names)`` (default
    :func:`_tp_rank`) and wait for them, at most ``TP_TIMEOUT_S``."""
    ctx = mp.start_processes(
        target or _tp_rank, args=(world, _free_port(), workdir, names), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TP_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP ranks did not finish within {TP_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:  # only on failure or timeout are any still alive
            if p.is_alive():
                p.terminate()
                p.join(5)


def stories260k_hf(gguf_path, out_dir):
    """The real stories260K as an HF model (our GGUF import), eager attention."""
    from conversion.gguf import gguf_to_hf

    model = LlamaForCausalLM.from_pretrained(gguf_to_hf(gguf_path, out_dir)).eval()
    model.set_attn_implementation("eager")
    return {**model.config.to_dict(), "architectures": ["LlamaForCausalLM"]}, model


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory, fixtures_dir):
    """Per case: the HF model, input ids, and both ranks' outputs from one spawn of 2 processes."""
    workdir = tmp_path_factory.mktemp("tp2")
    cases = {}
    for name, case in TP_CASES.items():
        if case is None:
            cfg, hf = stories260k_hf(
                fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf", workdir / "stories_hf"
            )
        else:
            arch, tied, extra = case
            cfg, hf = tiny_hf(arch, tied, **extra)
        spec = GPTSpec.from_hf_config(cfg)
        ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(11))
        full = hf_to_megatron(cfg, hf.state_dict())
        payload = {"spec": spec.model_dump(), "ids": ids, "shards": shard_state(spec, full, 2)}
        torch.save(payload, workdir / f"{name}.pt")
        cases[name] = (cfg, hf, spec, ids, full)
    return run_cases(workdir, cases)


def run_cases(workdir, cases: dict[str, tuple], target=None) -> dict[str, tuple]:
    """Run 2 ranks of ``target`` (default :func:`_tp_rank`) over the cases saved in ``workdir``
    and return each case's tuple with both ranks' outputs appended."""
    start = time.monotonic()
    _run_ranks(2, str(workdir), list(cases), target)
    print(f"2 TP ranks, {len(cases)} cases: {time.monotonic() - start:.1f} s")
    return {
        name: (*case, [torch.load(workdir / f"{name}.rank{r}.pt", weights_only=True) for r in range(2)])
        for name, case in cases.items()
    }


@pytest.mark.parametrize("name", list(TP_CASES))
def test_tp2_logits_match_transformers(tp2_runs, name):
    """TP=2 logits equal transformers', measured against the exact (float64) transformers
    logits. A row-parallel layer sums its two halves in another order than one matmul, so
    fp32 rounding differs; for the real stories260K (logits up to 18) transformers' own fp32
    logits are ~1e-5 from the exact ones (how far depends on the CPU's kernels), and ours must
    be within max(TOL, 2 x that) of them (tests/numerics.py)."""
    cfg, hf, spec, ids, full, ranks = tp2_runs[name]
    ref = hf_logits_reference(hf, ids)
    errs = []
    for out in ranks:  # gpt_logits gathers the vocabulary: every rank has all of it
        assert out["logits"].shape == ref.fp32.shape == (2, 24, spec.vocab_size)
        errs.append((out["logits"] - ref.fp32).abs().max().item())
    print(
        f"TP=2 {name}: max |logit diff| vs transformers fp32 = {max(errs):.3e}; logits up to {ref.fp32.abs().max():.2f}"
    )
    for r, out in enumerate(ranks):
        ref.check(out["logits"], TOL, f"TP=2 {name} rank {r}")
    # Both sides' rounding together, each at most its exact-relative bound.
    assert max(errs) <= ref.bound(TOL) + ref.hf_rounding
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])


@pytest.mark.parametrize("name", list(TP_CASES))
def test_tp2_loaded_shards_merge_and_export_to_the_hf_weights(tp2_runs, name):
    """Export: the two ranks' loaded states merge to the imported full state, and that
    streams back to exactly the HF model's tensors."""
    cfg, hf, spec, ids, full, ranks = tp2_runs[name]
    merged = merge_shards(spec, [out["loaded"] for out in ranks])
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)
    hf_state = hf.state_dict()
    exported = dict(megatron_to_hf(cfg, merged))
    assert exported.keys() == hf_state.keys() - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    assert all(torch.equal(t, hf_state[k]) for k, t in exported.items())


@pytest.mark.parametrize("name", list(TP_CASES))
def test_tp2_matches_megatrons_own_sharding_and_gradients(tp2_runs, name):
    """megatron's behaviour as the oracle for the layouts: a TP=2 model initialised from a seed
    keeps, on each rank, exactly shard_state's part of the TP=1 model from the same seed (the
    fc1 stride-2 layout included); and the TP=2 gradients, reduced as megatron does and
    merged, equal TP=1's (so gpt_logits' vocabulary gather is differentiable)."""
    from engine.models.megatron import build_gpt_model, gpt_logits, load_mcore_state, mcore_state

    cfg, hf, spec, ids, full, ranks = tp2_runs[name]
    reference = build_gpt_model(spec, seed=3)
    expected = shard_state(spec, mcore_state(reference), 2)
    for r, out in enumerate(ranks):
        assert out["init"].keys() == expected[r].keys()
        for k, t in expected[r].items():
            assert torch.equal(out["init"][k], t), (r, k)
    load_mcore_state(reference, full)
    reference.eval()
    loss = torch.nn.functional.cross_entropy(
        gpt_logits(reference, ids)[:, :-1].reshape(-1, spec.vocab_size), ids[:, 1:].reshape(-1)
    )
    loss.backward()
    assert abs(ranks[0]["loss"].item() - loss.item()) < TOL and torch.equal(ranks[0]["loss"], ranks[1]["loss"])
    # Each rank's q/k_layernorm gradient covers only its own heads; megatron sums them over the
    # TP group after backward (distributed/finalize_model_grads.py,
    # _allreduce_non_tensor_model_parallel_grads). Every other replicated gradient is equal.
    rank_grads = [dict(out["grads"]) for out in ranks]
    for k in rank_grads[0]:
        if k.endswith(("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")):
            total = sum(g[k] for g in rank_grads)
            for g in rank_grads:
                g[k] = total
    grads = merge_shards(spec, rank_grads)
    worst = max((grads[k] - p.grad).abs().max().item() for k, p in reference.named_parameters())
    print(f"TP=2 {name}: max |grad diff| vs TP=1 = {worst:.3e}")
    assert worst < TOL
