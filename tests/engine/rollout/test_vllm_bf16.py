"""vLLM rollout under ``precision: bf16`` (one in-process engine for the module): it really
runs bfloat16 (weights, KV cache sized and allocated in bfloat16), it loads the bfloat16
export (``export.dtype``) and decodes it as transformers does, and it reloads the bfloat16
weights a mixed-precision trainer streams (buckets planned in the stream's dtype: half the
bytes of float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conversion.registry import megatron_to_hf
from engine.models.master_weights import to_mixed_precision
from engine.models.megatron import mcore_state
from engine.models.weight_buckets import BucketServer, plan_policy
from engine.rollout.base import SamplingSpec
from engine.rollout.factory import build_rollout_engine
from engine.storage.hf_io import export_model_dir
from engine.storage.model_dir import load_model_dir, save_model_dir
from tests.conversion.test_export_precision import MAX_NEW, tiny_policy

GREEDY = SamplingSpec(n=1, temperature=0.0, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Policy 1 exported in bfloat16 and served by vLLM at ``precision="bf16"`` from that
    directory (``load_format="auto"``); policy 2 (other weights, same architecture) exported too,
    as the reference for a weight reload. Returns a dict."""
    root = tmp_path_factory.mktemp("vllm_bf16")
    out = {}
    for name, seed, eos_from in (("one", 3, 0), ("two", 5, 1)):
        model, tok, prompts, hf_config, tok_dir = tiny_policy(root, seed=seed, eos_from=eos_from)
        model_dir = save_model_dir(root / name, model, hf_config, tok_dir)
        out[name] = {
            "model": model,
            "dir": model_dir,
            "hf": export_model_dir(model_dir, root / f"{name}_hf", dtype="bfloat16"),
        }
    # policy 2 as a mixed-precision trainer holds it: bfloat16 compute weights (fp32 masters aside)
    out["two"]["bf16"] = load_model_dir(root / "two").model
    to_mixed_precision(out["two"]["bf16"])
    out.update(tok=tok, prompts=prompts, hf_config=hf_config)
    # 3 prompts, each at most one 128-token block long
    out["engine"] = build_rollout_engine(
        "vllm",
        out["one"]["hf"],
        what="rl.rollout.backend",
        tokenizer=tok,
        precision="bf16",
        num_sequences=3,
        max_model_len=64,
    )
    out["first"] = out["engine"].generate(prompts, GREEDY)
    return out


def test_engine_runs_bfloat16_with_a_bfloat16_kv_cache(setup):
    engine = setup["engine"]
    assert engine.dtype == torch.bfloat16
    # per token: 2 layers x 2 (K and V) x 1 KV head x 32 dims x 2 bytes = 256 bytes; a 128-token block 32,768
    # 3 sequences x 1 block + 1 null block = 4 blocks = 131,072 bytes; +10% = 144,179.2 -> 144,180
    # (half of float32's 288,359)
    assert engine.kv_cache_memory_bytes == 144_180
    vllm_config = engine.llm.llm_engine.vllm_config
    assert vllm_config.model_config.dtype == torch.bfloat16 and vllm_config.cache_config.num_gpu_blocks == 4

    def dtypes(worker):
        from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

        runner = worker.model_runner
        # On a CPU with AMX tiles vLLM runs small bfloat16 projections with its packed-weight
        # kernel (utils.dispatch_cpu_unquantized_gemm), which takes their bias in float32: those
        # biases are expected in float32, every other parameter in bfloat16.
        sgl_biases = {
            f"{name}.bias"
            for name, module in runner.model.named_modules()
            if getattr(module, "bias", None) is not None
            and hasattr(module, "output_size_per_partition")
            and check_cpu_sgl_kernel(module.output_size_per_partition, module.input_size_per_partition, torch.bfloat16)
        }
        return (
            {n: str(p.dtype) for n, p in runner.model.named_parameters() if p.numel() > 0},
            sgl_biases,
            {str(c.dtype) for c in runner.kv_caches},
        )

    [(params, sgl_biases, caches)] = engine.llm.collective_rpc(dtypes)
    assert params and caches == {"torch.bfloat16"}
    assert {n: d for n, d in params.items() if d != "torch.bfloat16"} == {n: "torch.float32" for n in sgl_biases}
    assert torch.cpu._is_amx_tile_supported() or not sgl_biases  # the packed kernel needs AMX


# vLLM's bfloat16 against transformers' bfloat16 (same weights): two implementations, each
# rounding activations to 8 mantissa bits in its own order. On these weights transformers'
# own bfloat16 log-probs differ from its float32 ones (same bfloat16 weights) by up to 0.11
# nats (0.012 on average; measured over every vocabulary entry of 96 positions), and vLLM's
# from transformers' by up to 0.08 on the sampled tokens, so two bf16 engines may be ~0.25
# apart. Wrong weights are off by nats (the next-best tokens are 3-6 logits below the argmax).
BF16_TOL = 0.25


def assert_agrees_with_transformers(outputs, prompts, hf_dir):
    """Each output's tokens and log-probs, teacher-forced through transformers in bfloat16:
    every greedy token is transformers' argmax up to ``BF16_TOL`` (a near-tie may resolve
    either way in bf16, so the decodings themselves need not be equal), and every log-prob
    matches within ``BF16_TOL``. Returns the number of tokens compared."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert hf.dtype == torch.bfloat16  # from config.json's dtype
    count = 0
    for prompt, (out,) in zip(prompts, outputs):
        ids, tokens = torch.tensor([prompt + list(out.token_ids)]), torch.tensor(out.token_ids)
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].double()
        chosen = logits.gather(-1, tokens[:, None])[:, 0]
        assert torch.all(logits.max(-1).values - chosen <= BF16_TOL), (logits.max(-1).values - chosen).tolist()
        logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), logprobs, rtol=0, atol=BF16_TOL)
        count += len(tokens)
    return count


def test_bfloat16_export_decodes_in_vllm_as_in_transformers(setup):
    first, tok = setup["first"], setup["tok"]
    assert any(o.finish_reason == "stop" and o.token_ids[-1] == tok.eos_token_id for (o,) in first)
    assert any(o.finish_reason == "length" and len(o.token_ids) == MAX_NEW for (o,) in first)
    assert assert_agrees_with_transformers(first, setup["prompts"], setup["one"]["hf"]) > 10


def test_bucket_plan_is_in_the_streams_dtype(setup):
    """A mixed-precision trainer's model holds bfloat16 compute weights: its HF stream is
    bfloat16 and the plan counts 2 bytes per element, half of the float32 model's."""
    model, bf16 = setup["two"]["model"], setup["two"]["bf16"]
    fp32_plan, bf16_plan = (plan_policy(setup["hf_config"], m, 2**16) for m in (model, bf16))
    assert {t.dtype for t in bf16_plan.tensors} == {torch.bfloat16}
    assert {t.dtype for t in fp32_plan.tensors} == {torch.float32}
    assert [t.name for t in bf16_plan.tensors] == [t.name for t in fp32_plan.tensors]
    assert 2 * bf16_plan.total_bytes == fp32_plan.total_bytes
    assert bf16_plan.num_buckets < fp32_plan.num_buckets


def test_reload_of_streamed_bfloat16_weights(setup):
    """Weight sync under bf16, bucket by bucket (64 KiB buckets of a mixed-precision model's
    bfloat16 compute weights, as the trainer streams them): policy 2 arrives (it agrees with
    transformers on policy 2's bfloat16 export); policy 1's stream gives back exactly what the
    engine decoded from policy 1's export on disk, tokens and log-probs. Float32 tensors are
    cast by the engine (round to nearest even, as the export and the trainer's cast do), so
    they load the same weights as the bfloat16 stream."""
    engine, prompts, hf_config = setup["engine"], setup["prompts"], setup["hf_config"]

    def stream(model):
        server = BucketServer(hf_config, model, 2**16)
        assert server.plan.num_buckets > 1
        for index in range(server.plan.num_buckets):
            bucket = server.bucket(index)
            assert {t.dtype for _, t in bucket} == {torch.bfloat16}
            engine.update_weights(bucket)

    one = load_model_dir(setup["one"]["dir"]).model
    to_mixed_precision(one)
    try:
        stream(setup["two"]["bf16"])
        second = engine.generate(prompts, GREEDY)
        assert second != setup["first"]
        assert_agrees_with_transformers(second, prompts, setup["two"]["hf"])
        stream(one)
        assert engine.generate(prompts, GREEDY) == setup["first"]
        engine.update_weights(megatron_to_hf(hf_config, mcore_state(setup["two"]["model"])))  # float32
        assert engine.generate(prompts, GREEDY) == second
    finally:
        engine.update_weights(megatron_to_hf(hf_config, mcore_state(setup["one"]["model"])))  # float32
    assert engine.generate(prompts, GREEDY) == setup["first"]
