"""What tests/engine/distributed/test_expert_parallel.py runs on the ranks of an expert-parallel
group (a module of its own: the Ray ranks import it by name)."""

from __future__ import annotations


def expert_flags(spec_config: dict) -> list[dict[str, tuple[list[int], bool, float]]]:
    """On every rank of an EP group: the model built as the stages build it; each rank's
    ``{name: (shape, allreduce flag, sum of the weight)}``, gathered (a collective)."""
    import torch.distributed as dist

    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model

    model = build_gpt_model(GPTSpec.from_hf_config(spec_config), seed=0, core_attention="sdpa")
    mine = {
        n: (list(p.shape), bool(getattr(p, "allreduce", True)), float(p.detach().double().sum()))
        for n, p in model.named_parameters()
    }
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out
