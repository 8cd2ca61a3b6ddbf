"""The memory planner (config/memory_plan.py): parameter counts against published checkpoints
and against megatron's own tensor-parallel shards, bytes per rank computed by hand, the
refusals with their exact messages, and the docs table equal to the planner's output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from config.memory_estimates import (
    GIB,
    PROCESS_BYTES,
    ModelShape,
    RoleMemory,
    kv_cache_bytes,
    padded_vocab,
    rollout_role,
    training_role,
)
from config.memory_plan import (
    QWEN25,
    check_layouts,
    check_plan,
    host_memory_bytes,
    render_table,
    tensor_parallel_problems,
)
from config.parallel import ParallelConfig

REPO = Path(__file__).resolve().parents[2]
# A Qwen2-style model small enough to count by hand: h 64, 2 layers, 4 heads of 16 (2 KV
# heads), SwiGLU 128, 256 tokens, tied embeddings, q/k/v biases.
TINY = dict(
    architectures=["Qwen2ForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    tie_word_embeddings=True,
)


def test_parameter_counts_are_the_published_checkpoints():
    """Qwen2.5-0.5B, -1.5B and -7B (the sizes of their config.json files) have 494,032,768,
    1,543,714,304 and 7,615,616,512 parameters (the counts of their safetensors checkpoints)."""
    counts = {
        name: ModelShape.from_hf_config({"architectures": ["Qwen2ForCausalLM"], **hf}).rank_parameters()
        for name, hf in QWEN25.items()
    }
    assert counts == {"Qwen2.5-0.5B": 494_032_768, "Qwen2.5-1.5B": 1_543_714_304, "Qwen2.5-7B": 7_615_616_512}


@pytest.mark.parametrize(
    "arch,extra", [("qwen2", {}), ("llama", {"tie_word_embeddings": False}), ("qwen3", {"attention_bias": True})]
)
def test_rank_parameters_equal_megatron_shards(arch, extra):
    """Per TP rank, the planner's count equals the elements of rank 0's shard that
    conversion.tensor_parallel.shard_state cuts from a full megatron state (every tensor of
    the architecture's mcore_shapes), and at TP 1 the full state's."""
    import torch

    from conversion.registry import FAMILIES
    from conversion.spec import GPTSpec
    from conversion.tensor_parallel import shard_state

    hf_class = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    hf = {
        **TINY,
        "architectures": [hf_class],
        "model_type": arch,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        **extra,
    }
    spec = GPTSpec.from_hf_config(hf)
    full = {name: torch.zeros(shape) for name, shape in FAMILIES[hf_class].mcore_shapes(spec).items()}
    shape = ModelShape.from_hf_config(hf)
    assert shape.rank_parameters() == sum(t.numel() for t in full.values())
    for tp in (2, 4 if arch != "qwen3" else 2):
        if shape.num_key_value_heads % tp:
            continue
        shard = shard_state(spec, full, tp)[0]
        assert shape.rank_parameters(tp, 256) == sum(t.numel() for t in shard.values()), tp


def test_bytes_per_rank_by_hand():
    """The tiny model: P = 256*64 (embedding) + 2 layers x (qkv 128*64 + bias 128 + proj
    64*64 + fc1 2*128*64 + fc2 64*128 + norms 2*64) + final norm 64 = 90,688 parameters; at
    TP 2 the split part halves: (16,384 + 2 x 36,992) / 2 + 2 x 128 + 64 = 45,504."""
    shape = ModelShape.from_hf_config(TINY)
    assert shape.rank_parameters() == 90_688 and shape.rank_parameters(2, 256) == 45_504
    p = 90_688
    # one micro-batch of b=2 sequences of s=32 tokens, per layer s*b*h*(34 + 5*a*s/h) bytes in
    # bf16 = 4096 * (34 + 10) = 180,224, two layers, plus fp32 logits and log-softmax 8*s*b*V = 131,072
    actor = training_role("actor", "rl.parallel.actor", shape, ParallelConfig(), "bf16", 2, 32, 256)
    assert actor.parts == {
        "weights": 2 * p,
        "master_weights": 4 * p,
        "gradients": 4 * p,
        "optimizer": 8 * p,
        "activations": 2 * 180_224 + 131_072,
    }
    assert actor.per_rank == 18 * p + 491_520 == 2_123_904
    fp32 = training_role("actor", "rl.parallel.actor", shape, ParallelConfig(), "fp32", 2, 32, 256)
    assert fp32.parts == {
        "weights": 4 * p,
        "master_weights": 0,
        "gradients": 4 * p,
        "optimizer": 8 * p,
        "activations": 2 * 2 * 180_224 + 131_072,
    }
    # TP 2: s*b*h*(10 + 24/2 + 5*a*s/(h*2)) = 4096 * 27 = 110,592 per layer; logits / 2
    tp2 = training_role(
        "actor",
        "rl.parallel.actor",
        shape,
        ParallelConfig(tensor_model_parallel_size=2, data_parallel_size=3),
        "bf16",
        2,
        32,
        256,
    )
    assert tp2.ranks == 6 and tp2.per_rank == 18 * 45_504 + 2 * 110_592 + 65_536 == 1_105_792
    # packing (sdpa attention): no 5*a*s^2*b term: 4096 * 34 per layer
    packed = training_role("actor", "k", shape, ParallelConfig(), "bf16", 2, 32, 256, packing=True)
    assert packed.parts["activations"] == 2 * 4096 * 34 + 131_072
    reference = training_role(
        "reference", "rl.parallel.reference", shape, ParallelConfig(), "bf16", 2, 32, 256, trainable=False
    )
    assert reference.parts == {"weights": 2 * p, "activations": 131_072}
    critic = training_role("critic", "rl.parallel.critic", shape, ParallelConfig(), "fp32", 2, 32, 256, logits=False)
    assert critic.parts["weights"] == 4 * (p + 64 + 1) and critic.parts["activations"] == 2 * 2 * 180_224
    # rollout: 64 sequences of 40 tokens hold 64 one-block (128-token) sequences + vLLM's null
    # block: 65 * 128 tokens * 2 layers * (K, V) * 2 KV heads * 16 * 2 bytes = 2,129,920, +10%
    rollout = rollout_role(shape, "bf16", 64, 40)
    assert rollout.parts == {"weights": 2 * p, "kv_cache": 2_342_912}


def test_lora_parameters_equal_the_adapters_and_only_they_train():
    """Rank 4 on all four layer kinds of the tiny model: per layer qkv A 4*64 + B 128*4, fc1
    A 4*64 + B 256*4, proj A 4*64 + B 64*4, fc2 A 4*128 + B 64*4 = 3,328, two layers 6,656 (the
    adapters engine.models.lora.apply_lora adds to the megatron model); at TP 2 the split half
    (qkv and fc1 B, proj and fc2 A: 2,304 per layer) halves: 2 x (1,024 + 1,152) = 4,352. The
    bf16 LoRA actor holds the base and adapter weights, and masters, gradients and AdamW
    moments of the adapters only."""
    from config.lora import LoraConfig
    from conversion.spec import GPTSpec
    from engine.models.lora import apply_lora
    from engine.models.megatron import build_gpt_model

    lora = LoraConfig(enabled=True, rank=4)
    shape = ModelShape.from_hf_config(TINY)
    assert shape.lora_parameters(lora) == 6_656 and shape.lora_parameters(lora, 2) == 4_352
    hf = {**TINY, "model_type": "qwen2", "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "hidden_act": "silu"}
    model = build_gpt_model(GPTSpec.from_hf_config(hf))
    apply_lora(model, lora)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 6_656
    two = LoraConfig(enabled=True, rank=4, target_modules=["linear_proj", "linear_fc2"])
    assert shape.lora_parameters(two) == 2 * (256 + 256 + 512 + 256)
    p, a = 90_688, 6_656
    actor = training_role("actor", "rl.parallel.actor", shape, ParallelConfig(), "bf16", 2, 32, 256, lora=lora)
    assert actor.parts == {
        "weights": 2 * (p + a),
        "master_weights": 4 * a,
        "gradients": 4 * a,
        "optimizer": 8 * a,
        "activations": 2 * 180_224 + 131_072,
    }
    off = training_role("actor", "k", shape, ParallelConfig(), "bf16", 2, 32, 256, lora=LoraConfig())
    assert off.parts == training_role("actor", "k", shape, ParallelConfig(), "bf16", 2, 32, 256).parts


def test_kv_cache_equals_the_engines():
    """The planner's torch-free copy of the KV cache size equals the function that sizes the
    real vLLM engine (engine/rollout/kv_cache.py)."""
    from engine.rollout.kv_cache import kv_cache_bytes as engine_kv

    for name, hf in QWEN25.items():
        shape = ModelShape.from_hf_config({"architectures": ["Qwen2ForCausalLM"], **hf})
        for seqs, tokens, precision, dtype in ((64, 40, "bf16", "bfloat16"), (512, 1300, "fp32", "float32")):
            assert kv_cache_bytes(shape, seqs, tokens, precision) == engine_kv(hf, seqs, tokens, dtype), name


def test_tensor_parallel_sizes_that_do_not_divide_are_refused():
    shape = ModelShape.from_hf_config({"architectures": ["Qwen2ForCausalLM"], **QWEN25["Qwen2.5-0.5B"]})
    assert tensor_parallel_problems("rl.parallel.actor", shape, 2, 151_936, "m") == []
    assert tensor_parallel_problems("rl.parallel.actor", shape, 4, 151_936, "Qwen2.5-0.5B") == [
        "rl.parallel.actor.tensor_model_parallel_size=4 does not divide num_attention_heads 14, num_key_value_heads 2 "
        "of Qwen2.5-0.5B: megatron-core splits each evenly across the tensor-parallel ranks; use a size that divides "
        "them"
    ]
    tiny = ModelShape.from_hf_config({**TINY, "vocab_size": 271})
    assert padded_vocab(271, 128) == 384 and padded_vocab(271, 5) == 275  # 275 rows do not split in two
    assert tensor_parallel_problems("rl.parallel.critic", tiny, 2, padded_vocab(271, 128), "tiny") == []
    assert tensor_parallel_problems("rl.parallel.critic", tiny, 2, padded_vocab(271, 5), "tiny") == [
        "rl.parallel.critic.tensor_model_parallel_size=2 does not divide padded vocabulary 275 of tiny (pad it "
        "further: convert.make_vocab_size_divisible_by): megatron-core splits each evenly across the tensor-parallel "
        "ranks; use a size that divides them"
    ]


def _role(role, key, ranks, per_rank, gpus=0.0, cpus=None) -> RoleMemory:
    return RoleMemory(role, key, ranks, gpus, {"weights": per_rank}, cpus)


def test_refusals_name_the_key_with_exact_messages():
    plans = {
        "rl": [_role("actor", "rl.parallel.actor", 2, 9 * GIB, gpus=1.0), _role("rollout", "rl.rollout", 1, 3 * GIB)]
    }
    problems, notes = check_plan(plans, local=False, cpus={"rl": 2}, gpus=0, device_memory_gib=8, host_bytes=None)
    assert problems == [
        "rl.parallel.actor: a rank needs about 9.00 GiB (actor 2 x 9.00 GiB (weights 9.00)) but has 8.00 GiB "
        "(rl.parallel.actor.gpus_per_rank 1 x run.device_memory_gib 8); raise rl.parallel.actor."
        "tensor_model_parallel_size or gpus_per_rank, or lower the micro-batch (estimates: docs/scaling.md)"
    ]
    assert notes == ["memory plan (rl): actor 2 x 9.00 GiB (weights 9.00); rollout 1 x 3.00 GiB (weights 3.00)"]
    # half a GPU per rank: 4 GiB each; not checked without run.device_memory_gib (a note says so)
    half = {"rl": [_role("actor", "rl.parallel.actor", 1, 3 * GIB, gpus=0.5)]}
    assert check_plan(half, local=False, cpus={"rl": 2}, gpus=0, device_memory_gib=8, host_bytes=None)[0] == []
    assert check_plan(half, local=False, cpus={"rl": 2}, gpus=0, device_memory_gib=None, host_bytes=None)[1][1] == (
        "memory plan (rl): GPU ranks are not checked against device memory; set run.device_memory_gib"
    )
    # a local cluster: host ranks together against MemTotal, each also a process; ranks against CPUs and GPUs
    host = {
        "rl": [
            _role("actor", "rl.parallel.actor", 2, 5 * GIB),
            _role("rollout", "rl.rollout", 1, 2 * GIB),
            _role("critic", "rl.parallel.critic", 1, 1 * GIB, gpus=1.0),
        ]
    }
    problems, _ = check_plan(host, local=True, cpus={"rl": 1.5}, gpus=0, device_memory_gib=None, host_bytes=12 * GIB)
    need = (2 * 5 + 2) * GIB + 3 * PROCESS_BYTES  # the critic is on a GPU
    assert problems == [
        f"rl.parallel.actor: the rl stage's ranks on this machine need about {need / GIB:.2f} GiB together (actor 2 x "
        "5.00 GiB (weights 5.00); rollout 1 x 2.00 GiB (weights 2.00); 480 MiB more per rank for its process) but the "
        "machine has 12.00 GiB (MemTotal); lower the micro-batch or the ranks, or join a cluster of several nodes "
        "(rl.engine.ray_address; estimates: docs/scaling.md)",
        "rl.parallel.actor: 2 ranks (data_parallel_size x tensor_model_parallel_size) exceed the 1.5 CPUs the local "
        "Ray cluster gives the rl stage's training (rl.engine.num_cpus, else this machine's cores, minus "
        "rl.engine.rollout_cpus when disaggregated); lower the sizes or join a larger cluster (rl.engine.ray_address)",
        "rl.parallel.critic: 1 rank x rl.parallel.critic.gpus_per_rank 1 exceed the 0 GPU(s) of this machine",
    ]
    # the same layout on a cluster the engine joins: its nodes are not this machine's, nothing to refuse here
    assert check_plan(host, local=False, cpus={"rl": 1.5}, gpus=0, device_memory_gib=None, host_bytes=12 * GIB)[0] == []
    spread = {"sft": [_role("sft", "sft.parallel", 2, GIB, cpus=1.5)]}
    assert check_plan(spread, local=True, cpus={"sft": 2}, gpus=0, device_memory_gib=None, host_bytes=None)[0] == [
        "sft.parallel: 2 ranks (data_parallel_size x tensor_model_parallel_size) x sft.parallel.cpus_per_rank 1.5 "
        "exceed the 2 CPUs the local Ray cluster gives the sft stage's training (rl.engine.num_cpus, else this "
        "machine's cores, minus rl.engine.rollout_cpus when disaggregated); lower the sizes or join a larger cluster "
        "(rl.engine.ray_address)"
    ]


def test_check_layouts_gives_rl_training_the_cpus_left_by_the_rollout(fixtures_dir):
    """On a local cluster of rl.engine.num_cpus 3 with a disaggregated rollout bundle of 1 CPU,
    the rl stage's training has 2 CPUs: 4 data-parallel actor ranks are refused, 2 are not; on
    a cluster the engine joins nothing of this machine is checked; a stage without a sequence
    length (its data not read yet) is not planned."""
    from config import PipelineConfig

    def cfg(**actor):
        return PipelineConfig.model_validate(
            {
                "run": {"name": "t", "precision": "fp32"},
                "model": {"source": "m"},
                "data": {"rl_train": {"path": "x.jsonl"}, "rl_eval": {"path": "y.jsonl"}},
                "sft": {"enabled": False},
                "rm": {"enabled": False},
                "rl": {
                    "micro_batch_size": 1,
                    "parallel": {"actor": actor},
                    "engine": {"num_cpus": 3, "placement": "disaggregated", "rollout_cpus": 1},
                },
            }
        )

    problems, notes = check_layouts(cfg(data_parallel_size=4), TINY, {"rl": 40}, "tiny", None)
    assert problems == [
        "rl.parallel.actor: 4 ranks (data_parallel_size x tensor_model_parallel_size) exceed the 2 CPUs the local "
        "Ray cluster gives the rl stage's training (rl.engine.num_cpus, else this machine's cores, minus "
        "rl.engine.rollout_cpus when disaggregated); lower the sizes or join a larger cluster (rl.engine.ray_address)"
    ]
    assert notes[0].startswith("memory plan (rl, sequences of 40 tokens): actor 4 x ")
    assert check_layouts(cfg(data_parallel_size=2), TINY, {"rl": 40}, "tiny", None)[0] == []
    assert check_layouts(cfg(data_parallel_size=4), TINY, {"rl": 40}, "tiny", "10.0.0.1:6379")[0] == []
    assert check_layouts(cfg(data_parallel_size=4), TINY, {}, "tiny", None) == ([], [])


def test_host_memory_is_memtotal(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683584 kB\nMemFree:         1000 kB\n")
    assert host_memory_bytes(str(meminfo)) == 24683584 * 1024
    assert host_memory_bytes(str(tmp_path / "absent")) is None
    assert host_memory_bytes() is None or host_memory_bytes() > 0


def test_docs_table_is_the_planners_output():
    doc = (REPO / "docs" / "scaling.md").read_text()
    assert render_table() in doc, "docs/scaling.md is stale: regenerate the table with `python -m config.memory_plan`"


def test_planner_and_validate_import_no_torch():
    """validate stays fast: the planner and the preflight module load without torch."""
    code = "import sys, config.memory_plan, flows.preflight; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_po_is_planned_as_laid_out_training_both_sides_of_its_pairs():
    """The po stage: po.parallel's ranks training the policy on micro-batches of chosen and
    rejected sequences (2 x po.micro_batch_size; unpaired KTO rows one each), with no second
    model (the reference's log-probs are cached), LoRA counted as for sft; a tensor-parallel
    size that does not divide the model is refused naming po.parallel."""
    from config import PipelineConfig
    from config.memory_plan import plan_stages

    def cfg(**extra):
        return PipelineConfig.model_validate(
            {
                "run": {"name": "t", "precision": "bf16"},
                "model": {"source": "m"},
                "data": {"preference": {"path": "p.jsonl"}, "rl_eval": {"path": "y.jsonl"}, **extra.pop("data", {})},
                "sft": {"enabled": False},
                "rm": {"enabled": False},
                "po": {"enabled": True, "micro_batch_size": 1, "global_batch_size": 4, **extra},
            }
        )

    plans = plan_stages(cfg(), TINY, {"po": 32})
    assert list(plans) == ["po"]
    (po,) = plans["po"]
    # a pair is b = 2 sequences of 32 tokens: the actor's bytes of test_bytes_per_rank_by_hand
    assert (po.role, po.key, po.ranks) == ("po", "po.parallel", 1)
    assert (
        po.parts
        == training_role("actor", "k", ModelShape.from_hf_config(TINY), ParallelConfig(), "bf16", 2, 32, 256).parts
    )
    assert po.per_rank == 2_123_904
    lora = plan_stages(cfg(lora={"enabled": True, "rank": 4}), TINY, {"po": 32})["po"][0]
    assert lora.parts["optimizer"] == 8 * 6_656 and lora.parts["weights"] == 2 * (90_688 + 6_656)
    # unpaired KTO rows: b = 1, per layer s*b*h*(34 + 5*a*s/h) = 2048 * 44, two layers, + logits 8*s*b*V
    kto = plan_stages(cfg(loss="kto", data={"kto": {"path": "k.jsonl"}}), TINY, {"po": 32})["po"][0]
    assert kto.parts["activations"] == 2 * 2048 * 44 + 8 * 32 * 1 * 256
    assert plan_stages(cfg(enabled=False), TINY, {"po": 32}) == {}
    problems, notes = check_layouts(cfg(), TINY, {"po": 32}, "tiny", None)
    assert problems == [] and notes[0].startswith("memory plan (po, sequences of 32 tokens): po 1 x ")
    dp2_tp2 = plan_stages(cfg(parallel={"data_parallel_size": 2, "tensor_model_parallel_size": 2}), TINY, {"po": 32})
    assert dp2_tp2["po"][0].ranks == 4
    problems, _ = check_layouts(cfg(parallel={"tensor_model_parallel_size": 8}), TINY, {"po": 32}, "tiny", None)
    assert problems == [
        "po.parallel.tensor_model_parallel_size=8 does not divide num_attention_heads 4, num_key_value_heads 2 of "
        "tiny: megatron-core splits each evenly across the tensor-parallel ranks; use a size that divides them"
    ]


def test_rl_reward_model_is_planned_and_checked_as_laid_out():
    """The reward model that scores RL responses (rl.reward.reward_model_weight != 0) is a role
    of rl.parallel.reward_model's ranks, frozen, with its scalar head and no vocabulary logits;
    a tensor-parallel size that does not divide the model is refused naming that key; no
    reward model, no role."""
    from config import PipelineConfig
    from config.memory_plan import plan_stages

    def cfg(weight=0.5, **layout):
        return PipelineConfig.model_validate(
            {
                "run": {"name": "t", "precision": "bf16"},
                "model": {"source": "m"},
                "data": {"rl_train": {"path": "x.jsonl"}, "rl_eval": {"path": "y.jsonl"}},
                "sft": {"enabled": False},
                "rm": {"enabled": weight != 0},
                "rl": {
                    "micro_batch_size": 2,
                    "reward": {"reward_model_weight": weight},
                    "parallel": {"reward_model": layout},
                },
            }
        )

    layout = ParallelConfig(data_parallel_size=2, tensor_model_parallel_size=2)
    (reward,) = [
        r
        for r in plan_stages(cfg(data_parallel_size=2, tensor_model_parallel_size=2), TINY, {"rl": 32})["rl"]
        if r.role == "reward"
    ]
    assert (reward.key, reward.ranks) == ("rl.parallel.reward_model", 4)
    want = training_role(
        "reward", "k", ModelShape.from_hf_config(TINY), layout, "bf16", 2, 32, 256, trainable=False, logits=False
    )
    assert reward.parts == want.parts
    # frozen bf16 weights of one TP=2 rank: its shard of the body plus the replicated head (h + 1)
    assert reward.parts["weights"] == 2 * (ModelShape.from_hf_config(TINY).rank_parameters(2, 256) + 64 + 1)
    assert not [r for r in plan_stages(cfg(weight=0), TINY, {"rl": 32})["rl"] if r.role == "reward"]
    problems, _ = check_layouts(cfg(tensor_model_parallel_size=8), TINY, {"rl": 32}, "tiny", None)
    assert problems == [
        "rl.parallel.reward_model.tensor_model_parallel_size=8 does not divide num_attention_heads 4, "
        "num_key_value_heads 2 of tiny: megatron-core splits each evenly across the tensor-parallel ranks; use a size "
        "that divides them"
    ]


def test_rl_gpus_are_counted_by_the_placement_and_the_rollout_by_its_keys():
    """The other stages' roles reserve their GPUs together (an sft group of 2 x 1 GPU on a 1-GPU
    machine is refused); the RL stage's GPUs are counted per bundle by the placement plan
    (colocated roles share a device: tests/config/test_placement_plan.py), not summed here; with
    vLLM's gpu_memory_utilization the rollout engine's KV cache is what that share of its GPUs
    leaves after the weights."""
    from config import PipelineConfig
    from config.memory_estimates import WEIGHT_BYTES
    from config.memory_plan import plan_stages

    plans = {
        "rl": [_role("actor", "rl.parallel.actor", 2, GIB, gpus=1.0), _role("rollout", "rl.rollout", 2, GIB, gpus=1.0)]
    }
    assert check_plan(plans, local=True, cpus={"rl": 2}, gpus=2, device_memory_gib=None, host_bytes=None)[0] == []
    sft = {"sft": [_role("sft", "sft.parallel", 2, GIB, gpus=1.0), _role("rollout", "rl.rollout", 1, GIB, gpus=1.0)]}
    assert check_plan(sft, local=True, cpus={"sft": 2}, gpus=2, device_memory_gib=None, host_bytes=None)[0] == [
        "sft: its roles reserve 3 GPUs together (2 x sft.parallel.gpus_per_rank 1 + 1 x rl.rollout.gpus_per_engine 1) "
        "but this machine has 2; lower the ranks, the GPUs per rank or engine, or rl.rollout.num_engines, or join a "
        "larger cluster (rl.engine.ray_address)"
    ]
    engines = {"rl": [_role("rollout", "rl.rollout", 1, GIB, gpus=1.0)]}
    # an engine larger than its GPUs: the rollout's own keys, not a training rank's
    assert check_plan(engines, local=False, cpus={"rl": 2}, gpus=0, device_memory_gib=0.5, host_bytes=None)[0] == [
        "rl.rollout: an engine needs about 1.00 GiB (rollout 1 x 1.00 GiB (weights 1.00)) but has 0.50 GiB "
        "(rl.rollout.gpus_per_engine 1 x run.device_memory_gib 0.5); raise rl.rollout.gpus_per_engine, lower "
        "rl.rollout.gpu_memory_utilization, or give each engine fewer sequences (rl.prompts_per_step x rl.n_samples "
        "over rl.rollout.num_engines; estimates: docs/scaling.md)"
    ]

    cfg = PipelineConfig.model_validate(
        {
            "run": {"name": "t", "precision": "bf16", "device_memory_gib": 8},
            "model": {"source": "m"},
            "data": {"rl_train": {"path": "x.jsonl"}, "rl_eval": {"path": "y.jsonl"}},
            "sft": {"enabled": False},
            "rm": {"enabled": False},
            "rl": {"rollout": {"gpus_per_engine": 1, "gpu_memory_utilization": 0.5}},
        }
    )
    (rollout,) = [r for r in plan_stages(cfg, TINY, {"rl": 32})["rl"] if r.role == "rollout"]
    weights = WEIGHT_BYTES["bf16"] * ModelShape.from_hf_config(TINY).rank_parameters(1)
    assert rollout.gpus_per_rank == 1.0 and rollout.parts == {"weights": weights, "kv_cache": 4 * GIB - weights}
