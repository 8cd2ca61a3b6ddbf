"""A sharded train state's names under expert parallelism: each rank's experts by their global index.

At ``expert_model_parallel_size`` E a rank holds ``num_experts / E`` experts of each MoE layer,
named ``...mlp.experts.local_experts.{j}...`` by their local index ``j``; megatron's
``SequentialMLP.sharded_state_dict`` saves expert ``j`` of rank ``r`` at its global index
``r * num_experts / E + j``, the last of its ``ShardedTensor``'s prepended axes. The train
state's common metadata (``engine.storage.train_state``: the state_dict names and their
checkpoint keys, the optimizer's parameter names, moments and scalars) names every expert by
that global index, gathered from every rank, so a state saved at one expert-parallel size reads
at another (its :attr:`TrainState.model` view holds every expert, as at EP=1).
"""

from __future__ import annotations

import re
from typing import Any

_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def is_expert(name: str) -> bool:
    """Whether ``name`` is a routed expert's parameter (``...local_experts.{j}...``)."""
    return _LOCAL_EXPERT.search(name) is not None


def global_names(keys: dict[str, tuple[str, list[int]]]) -> dict[str, str]:
    """``{state_dict name: its name at expert parallelism 1}`` for ``keys`` (``{name: (checkpoint
    key, offsets on the prepended axes)}``): an expert's local index replaced by the last offset,
    its global index (module docstring); every other name unchanged."""
    out = {}
    for name, (_, offsets) in keys.items():
        m = _LOCAL_EXPERT.search(name)
        out[name] = name if m is None or not offsets else f"{name[: m.start(1)]}{offsets[-1]}{name[m.end(1) :]}"
    return out


def gathered_metadata(
    keys: dict[str, tuple[str, list[int]]],
    names: list[str],
    moments: dict[str, list[str]],
    scalars: dict[str, dict[str, Any]],
) -> tuple[dict, list[str], dict, dict]:
    """This rank's checkpoint ``keys``, optimizer ``names`` (in optimizer order), moment names and
    scalars, renamed by :func:`global_names` and merged over every rank (a collective when the
    process group has several ranks; rank 0's entries first). Returns the four, merged."""
    # torch (via engine.distributed.collectives): seconds to import, not paid until this runs
    import torch.distributed as dist

    from engine.distributed.collectives import world_size

    glob = global_names(keys)
    mine = (
        {glob[n]: v for n, v in keys.items()},
        [glob.get(n, n) for n in names],
        {glob.get(n, n): v for n, v in moments.items()},
        {glob.get(n, n): v for n, v in scalars.items()},
    )
    if world_size() == 1:
        return mine
    ranks: list[Any] = [None] * world_size()
    dist.all_gather_object(ranks, mine)
    merged_names = list(dict.fromkeys(n for r in ranks for n in r[1]))
    return (
        {k: v for r in ranks for k, v in r[0].items()},
        merged_names,
        {k: v for r in ranks for k, v in r[2].items()},
        {k: v for r in ranks for k, v in r[3].items()},
    )


def name_mismatch(mine: list[str], saved: list[str]) -> list[str]:
    """Names (global, :func:`global_names`) only one of this rank's optimizer and a saved state
    has: all of this rank's must be saved; of the saved ones, the experts other ranks hold may
    be missing here."""
    return sorted((set(mine) - set(saved)) | {n for n in set(saved) - set(mine) if not is_expert(n)})
