"""check_experts (``posttrain validate``): expert parallelism against the model's experts, and
the MoE-only settings against a dense model, each one problem naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

from config import load_config
from flows.model_checks import ModelFacts, check_experts, planned_config

REPO = Path(__file__).resolve().parents[2]
MOE, DENSE = REPO / "configs" / "quickstart-moe.yaml", REPO / "configs" / "quickstart.yaml"
ROOM = ["sft.micro_batch_size=8", "rl.engine.num_cpus=8"]  # micro-batches and CPUs for the ranks


def _problems(config: Path, *overrides: str) -> list[str]:
    cfg = load_config(config, [*ROOM, *overrides])
    assert cfg.prepare is not None
    return check_experts(cfg, ModelFacts("work/model", planned_config(cfg.prepare)))


def test_the_moe_quickstart_as_shipped_passes():
    assert _problems(MOE) == []
    assert _problems(MOE, "sft.parallel.expert_model_parallel_size=2", "sft.parallel.data_parallel_size=2") == []


def test_expert_parallelism_must_divide_the_experts():
    experts = planned_config(load_config(MOE).prepare)["num_experts"]
    assert experts == 4
    for ep in (3, 8):  # not a divisor, and more ranks than experts
        problems = _problems(
            MOE, f"sft.parallel.expert_model_parallel_size={ep}", f"sft.parallel.data_parallel_size={ep}"
        )
        assert problems == [
            f"sft.parallel.expert_model_parallel_size={ep} must divide the 4 experts of each MoE layer of "
            f"work/model (each rank holds experts / {ep}): use a divisor of 4"
        ]


def test_a_dense_model_takes_neither_expert_parallelism_nor_routing_replay():
    ep = ("rl.parallel.actor.expert_model_parallel_size=2", "rl.parallel.actor.data_parallel_size=2")
    assert _problems(DENSE, *ep) == [
        "rl.parallel.actor.expert_model_parallel_size=2: work/model is a dense model (qwen2), it has no experts "
        "to shard: set it to 1"
    ]
    for value in ("true", "rollout"):
        assert _problems(DENSE, f"rl.moe_routing_replay={value}", "rl.rollout.backend=hf") == [
            f"rl.moe_routing_replay: {value} replays the expert choice of a "
            "mixture of experts; work/model is a dense model (qwen2): set rl.moe_routing_replay: false"
        ]


def test_an_moe_model_at_tensor_parallel_size_2_needs_sequence_parallelism():
    """megatron-core's MoELayer refuses to train at TP > 1 without sequence parallelism: validate
    says so with the key and the fix; with it (and for a dense model without it) nothing."""
    assert _problems(MOE, "sft.parallel.tensor_model_parallel_size=2") == [
        "sft.parallel.tensor_model_parallel_size=2: work/model is a mixture of experts, which megatron-core "
        "trains at tensor-parallel size > 1 only with sequence parallelism: set sft.parallel.sequence_parallel: true"
    ]
    assert _problems(MOE, "sft.parallel.tensor_model_parallel_size=2", "sft.parallel.sequence_parallel=true") == []
    assert _problems(DENSE, "sft.parallel.tensor_model_parallel_size=2") == []


def test_routing_replay_with_a_tensor_parallel_actor_needs_only_sequence_parallelism():
    tp2 = ("rl.moe_routing_replay=true", "rl.parallel.actor.tensor_model_parallel_size=2")
    assert _problems(MOE, *tp2, "rl.parallel.actor.sequence_parallel=true") == []
    assert _problems(MOE, *tp2) == [
        "rl.parallel.actor.tensor_model_parallel_size=2: work/model is a mixture of experts, which megatron-core "
        "trains at tensor-parallel size > 1 only with sequence parallelism: set rl.parallel.actor.sequence_parallel: "
        "true"
    ]
