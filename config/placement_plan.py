"""Where the RL stage's workers sit: one placement-group bundle per training rank and, when
disaggregated, one per rollout engine, sized from the config (pure: no Ray).

A *slot* is one training rank's place: the RL roles' ranks with the same index share it (rank
``i`` of the actor, the reference, the teacher, the critic and the reward model sit in slot
``i``), so there are as many slots as the largest role has ranks. Each slot is one Ray
placement-group bundle. This is verl's resource pool: one bundle per device, the roles of the
hybrid engine colocated on it, taking turns.

``rl.engine.placement: colocated``: rollout engine ``j`` of ``E`` shares the bundle of slot
``j * N // E`` (``N`` slots): actor rank ``i`` and engine ``j`` on the same devices. A bundle's
CPUs and GPUs are split in equal fractions among the workers in it, as verl's
``max_colocate_count`` does (``num_gpus = 1 / k`` for ``k`` colocated workers); they take turns,
so each runs on all of the bundle's CPUs. ``disaggregated``: the engines get bundles of their
own (``rl.engine.rollout_cpus / E`` CPUs and ``rl.rollout.gpus_per_engine`` GPUs each), so rollout
and training run at the same time; a training bundle then holds the GPUs of every rank in it
(the roles do not share a device there).

The bundles of one run form one placement group, which Ray may spread over the cluster's nodes
(each bundle on one node): ``rl.engine.placement_strategy`` PACK (the default: as few nodes as
fit) or SPREAD (one bundle per node where possible). :func:`unplaceable` checks a plan against
the nodes' shapes (``rl.engine.cluster_nodes``, the local machine, or the live cluster's
``ray.nodes()``), so ``posttrain validate`` and the engine say which layout cannot be placed,
naming the key, before anything waits for Ray.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from config.memory_plan import local_gpus
from config.stages import chat_trainers

if TYPE_CHECKING:
    from config.parallel import ParallelConfig
    from config.rl import RLConfig
    from config.schema import PipelineConfig


@dataclass(frozen=True)
class Bundle:
    """One placement-group bundle: ``cpus`` CPUs and ``gpus`` GPUs (Ray's logical units) on
    one node, and the workers in it (``occupants``: ``"actor 0"``, ``"rollout 1"``, ...)."""

    cpus: float
    gpus: float
    occupants: tuple[str, ...]

    @property
    def resources(self) -> dict[str, float]:
        """The bundle as Ray takes it: ``{"CPU": cpus}`` plus ``"GPU"`` when it has any."""
        return {"CPU": self.cpus, "GPU": self.gpus} if self.gpus else {"CPU": self.cpus}


@dataclass(frozen=True)
class Seat:
    """What one worker reserves: ``cpus`` and ``gpus`` of bundle ``bundle``, and the torch
    threads it runs (``threads``)."""

    bundle: int
    cpus: float
    gpus: float
    threads: int


@dataclass(frozen=True)
class PlacementPlan:
    """A run's bundles and the seat of every worker (:func:`plan_placement`).

    Attributes:
        mode: ``"colocated"`` or ``"disaggregated"`` (``rl.engine.placement``).
        strategy: ``"PACK"`` or ``"SPREAD"`` (``rl.engine.placement_strategy``).
        bundles: the placement group's bundles, training slots first.
        seats: ``(role, index) -> Seat``; roles ``actor``, ``reference``, ``teacher``,
            ``critic``, ``reward_model`` (index = global rank), ``reward`` (index 0) and
            ``rollout`` (index = engine).
        keys: ``bundle index -> (the key that sizes its CPUs, the key that sizes its GPUs)``
            (for error messages).
    """

    mode: str
    strategy: str
    bundles: tuple[Bundle, ...]
    seats: dict[tuple[str, int], Seat]
    keys: dict[int, tuple[str, str]] = field(default_factory=dict)

    def seat(self, role: str, index: int = 0) -> Seat:
        """The seat of worker ``index`` of ``role``.

        Raises: KeyError naming the role and index when the plan has no such worker."""
        try:
            return self.seats[(role, index)]
        except KeyError:
            raise KeyError(
                f"the placement has no {role} worker {index} (roles: {sorted({r for r, _ in self.seats})})"
            ) from None


# The training roles whose rank i sits in slot i, with the rl.parallel key that lays each out.
_LAYOUT_KEY = {
    "actor": "actor",
    "reference": "reference",
    "teacher": "reference",
    "critic": "critic",
    "reward_model": "reward_model",
}


def training_roles(cfg: RLConfig) -> dict[str, ParallelConfig]:
    """``role -> ParallelConfig`` of the run's training roles that start: the actor, the
    reference (with a KL term), the teacher (laid out as the reference), the critic
    (an estimator that needs one: ``gae``) and the reward model (``reward_model_weight != 0``)."""
    par = cfg.parallel
    roles = {"actor": par.actor}
    if cfg.uses_reference:
        roles["reference"] = par.reference
    if cfg.teacher is not None:
        roles["teacher"] = par.reference
    if cfg.algorithm_needs.critic:
        roles["critic"] = par.critic
    if cfg.uses_reward_model:
        roles["reward_model"] = par.reward_model
    return roles


def plan_placement(cfg: RLConfig, total_cpus: float) -> PlacementPlan:
    """The bundles and seats of an RL run (module docstring).

    Args:
        cfg: the rl section.
        total_cpus: CPUs the run reserves in all (``rl.engine.num_cpus``, else every CPU of
            the cluster); disaggregated, the rollout bundles take ``rl.engine.rollout_cpus``
            of them.

    Slot bundles hold ``rl.parallel.actor.cpus_per_rank`` CPUs when set, else an equal share
    of the training CPUs. Colocated, a slot bundle's GPUs are the most any worker in it asks
    for (``gpus_per_rank``, ``rl.rollout.gpus_per_engine``), shared in equal fractions; a
    worker's threads are the bundle's CPUs (colocated workers take turns; engines in one
    bundle generate together and split them), or its role's ``cpus_per_rank`` when set.

    Raises:
        ValueError: naming the key, when the CPUs leave a bundle none, or colocated workers
            would share more than one GPU each (Ray's fractional GPUs are below one device).
    """
    roles = training_roles(cfg)
    slots = max(layout.world_size for layout in roles.values())
    engines = cfg.rollout.num_engines
    disaggregated = cfg.engine.placement == "disaggregated"
    train_cpus = total_cpus - cfg.engine.rollout_cpus if disaggregated else float(total_cpus)
    if train_cpus <= 0:
        raise ValueError(
            f"rl.engine.rollout_cpus={cfg.engine.rollout_cpus:g} leaves no CPU of the run's "
            f"{total_cpus:g} (rl.engine.num_cpus) for training; lower it or raise rl.engine.num_cpus"
        )
    slot_cpus = float(cfg.parallel.actor.cpus_per_rank or train_cpus / slots)

    occupants: list[list[tuple[str, int, float]]] = [[] for _ in range(slots)]  # (role, index, gpus asked)
    for role, layout in roles.items():
        for rank in range(layout.world_size):
            occupants[rank].append((role, rank, float(layout.gpus_per_rank)))
    if cfg.reward_worker == "worker":  # a judge model's engine (rule rewards run in the driver)
        occupants[0].append(("reward", 0, 0.0))
    rollout_gpus = float(cfg.rollout.gpus_per_engine)
    if not disaggregated:
        for j in range(engines):
            occupants[j * slots // engines].append(("rollout", j, rollout_gpus))

    bundles, seats, keys = [], {}, {}
    for index, members in enumerate(occupants):
        gpu_members = [m for m in members if m[2] > 0]
        if disaggregated:
            gpus = sum(m[2] for m in gpu_members)
        else:
            gpus = max((m[2] for m in gpu_members), default=0.0)
            if len(gpu_members) > 1 and gpus > 1:
                worst = max(gpu_members, key=lambda m: m[2])
                raise ValueError(
                    f"{_gpu_key(cfg, worst[0])}={worst[2]:g}: colocated workers share their bundle's "
                    "GPU in fractions (verl's resource pools), so each may ask for at most 1; set it "
                    "to 1 (one device per rank), or rl.engine.placement: disaggregated"
                )
        engines_here = sum(1 for m in members if m[0] == "rollout")
        for role, rank, asked in members:
            share = (asked if disaggregated else gpus / len(gpu_members)) if asked > 0 else 0.0
            own = _cpus_per_rank(cfg, role)
            threads = own or (slot_cpus / engines_here if role == "rollout" else slot_cpus)
            seats[(role, rank)] = Seat(index, _floor4(slot_cpus / len(members)), _floor4(share), max(1, int(threads)))
        bundles.append(Bundle(slot_cpus, gpus, tuple(f"{role} {rank}" for role, rank, _ in members)))
        largest = max(gpu_members, key=lambda m: m[2], default=("actor", 0, 0.0))
        keys[index] = (
            "rl.parallel.actor.cpus_per_rank"
            if cfg.parallel.actor.cpus_per_rank
            else "rl.engine.num_cpus" + (" - rl.engine.rollout_cpus" if disaggregated else ""),
            _gpu_key(cfg, largest[0]),
        )
    if disaggregated:
        each = cfg.engine.rollout_cpus / engines
        for j in range(engines):
            seats[("rollout", j)] = Seat(len(bundles), _floor4(each), rollout_gpus, max(1, int(each)))
            keys[len(bundles)] = ("rl.engine.rollout_cpus", "rl.rollout.gpus_per_engine")
            bundles.append(Bundle(each, rollout_gpus, (f"rollout {j}",)))
    return PlacementPlan(cfg.engine.placement, cfg.engine.placement_strategy, tuple(bundles), seats, keys)


def _floor4(amount: float) -> float:
    # Ray keeps resource amounts to 1e-4; three seats of 2/3 CPU rounded up would not fit 2 CPUs
    return math.floor(amount * 10_000 + 1e-6) / 10_000


def _cpus_per_rank(cfg: RLConfig, role: str) -> float | None:
    if role not in _LAYOUT_KEY:
        return None
    return getattr(cfg.parallel, _LAYOUT_KEY[role]).cpus_per_rank


def _gpu_key(cfg: RLConfig, role: str) -> str:
    return "rl.rollout.gpus_per_engine" if role == "rollout" else f"rl.parallel.{_LAYOUT_KEY[role]}.gpus_per_rank"


def assign_to_nodes(bundles: Sequence[Bundle], nodes: Sequence[tuple[float, float]]) -> list[int] | None:
    """A node for every bundle such that no node holds more CPUs or GPUs than it has, or None
    when there is none (exact search: bundles largest first, each tried on every node with
    room; runs are a few dozen bundles at most).

    Args:
        bundles: the placement group's bundles.
        nodes: ``(cpus, gpus)`` of each node.

    Returns: ``node index`` per bundle, in the bundles' order, or None.
    """
    order = sorted(range(len(bundles)), key=lambda b: (bundles[b].gpus, bundles[b].cpus), reverse=True)
    free = [[c, g] for c, g in nodes]
    where: list[int] = [-1] * len(bundles)
    eps = 1e-9

    def place(k: int) -> bool:
        if k == len(order):
            return True
        b = bundles[order[k]]
        tried = set()
        for n, (c, g) in enumerate(free):
            if (c, g) in tried or b.cpus > c + eps or b.gpus > g + eps:
                continue
            tried.add((c, g))  # nodes with the same free resources are interchangeable
            free[n][0], free[n][1] = c - b.cpus, g - b.gpus
            where[order[k]] = n
            if place(k + 1):
                return True
            free[n][0], free[n][1] = c, g
        return False

    return where if place(0) else None


def unplaceable(plan: PlacementPlan, nodes: Sequence[tuple[float, float]]) -> list[str]:
    """Why ``plan`` cannot be placed on ``nodes`` (``(cpus, gpus)`` each), or ``[]``.

    A bundle larger than every node names the key that sizes it; bundles that each fit but not
    all together name the totals. A fit does not promise that the nodes are free now: Ray then
    waits for a busy cluster (``TimeoutError`` after a minute).
    """
    problems = []
    largest_cpus = max((c for c, _ in nodes), default=0.0)
    largest_gpus = max((g for _, g in nodes), default=0.0)
    for index, b in enumerate(plan.bundles):
        what = ", ".join(b.occupants)
        if b.cpus > largest_cpus + 1e-9:
            problems.append(
                f"{plan.keys[index][0]}: bundle {index} ({what}) needs {b.cpus:g} CPUs but the largest node "
                f"of the cluster has {largest_cpus:g} (a bundle sits on one node); lower it, set "
                "rl.parallel.actor.cpus_per_rank, or add ranks so that each bundle fits a node"
            )
        if b.gpus > largest_gpus + 1e-9:
            problems.append(
                f"{plan.keys[index][1]}: bundle {index} ({what}) needs {b.gpus:g} GPUs but the largest node of the "
                f"cluster has {largest_gpus:g}; lower the GPUs per rank or engine"
            )
    if problems:
        return problems
    if assign_to_nodes(plan.bundles, nodes) is None:
        cpus, gpus = sum(b.cpus for b in plan.bundles), sum(b.gpus for b in plan.bundles)
        have = ", ".join(f"{c:g} CPUs" + (f" + {g:g} GPUs" if g else "") for c, g in nodes)
        problems.append(
            f"rl.engine.placement: {plan.mode}: the run's {len(plan.bundles)} bundles ({cpus:g} CPUs"
            + (f", {gpus:g} GPUs" if gpus else "")
            + f") do not fit the cluster's nodes ({have}) "
            "together; lower rl.engine.num_cpus, the ranks or the engines, or add nodes"
        )
    return problems


def placement_table(plan: PlacementPlan, nodes_of_bundles: Sequence[str] | None = None) -> str:
    """The plan as a text table: one line per bundle with its node (when known), CPUs, GPUs
    and workers; what the engine logs when it starts and docs/scaling.md shows."""
    lines = [f"placement ({plan.mode}, {plan.strategy}): bundle | node | CPUs | GPUs | workers"]
    for index, b in enumerate(plan.bundles):
        node = nodes_of_bundles[index] if nodes_of_bundles else "-"
        lines.append(f"  {index} | {node} | {b.cpus:g} | {b.gpus:g} | {', '.join(b.occupants)}")
    return "\n".join(lines)


def check_placement(rl: RLConfig, cluster_address: str | None) -> tuple[list[str], list[str]]:
    """The RL run's bundles (:func:`plan_placement`) against the cluster's node shapes:
    ``rl.engine.cluster_nodes`` when given, else this machine when the cluster is local
    (``rl.engine.num_cpus`` or every core, and its GPUs); a cluster joined without
    ``cluster_nodes`` is checked when the run starts. Returns (problems naming the key, notes:
    the placement table)."""
    if rl.engine.cluster_nodes is not None:
        nodes = [(n.cpus, n.gpus) for n in rl.engine.cluster_nodes]
    elif cluster_address is None:
        nodes = [(float(rl.engine.num_cpus or os.cpu_count() or 1), float(local_gpus()))]
    else:
        nodes = None
    total = float(rl.engine.num_cpus or sum(c for c, _ in nodes or [(os.cpu_count() or 1, 0)]))
    try:
        plan = plan_placement(rl, total)
    except ValueError as exc:
        return [str(exc)], []
    notes = [
        f"placement ({plan.mode}, {plan.strategy}): "
        + "; ".join(
            f"bundle {i} = {b.cpus:g} CPUs" + (f" + {b.gpus:g} GPUs" if b.gpus else "") + f" ({', '.join(b.occupants)})"
            for i, b in enumerate(plan.bundles)
        )
    ]
    if nodes is None:
        return [], notes + [
            f"placement: checked against {cluster_address}'s nodes when the run starts (set "
            "rl.engine.cluster_nodes to check it here)"
        ]
    return unplaceable(plan, nodes), notes


def check_stage_cpus(cfg: PipelineConfig, cluster_address: str | None) -> list[str]:
    """The ranks of the sft, rm and po stages (those enabled, with ``<stage>.parallel`` of more
    than one rank and ``cpus_per_rank`` set) against the CPUs of the local Ray cluster they
    start (``rl.engine.num_cpus``, else this machine's), which the stage would otherwise
    refuse only when it starts (``engine.distributed.stage_group.run_stage``). A cluster that
    is joined (``cluster_address`` not None) is not checked: its size is known only once
    joined. ``posttrain run`` calls this; validate's memory plan checks the same once it has
    the model's sizes. Returns problems, each naming its key."""
    if cluster_address is not None:
        return []
    total = float(cfg.rl.engine.num_cpus or os.cpu_count() or 1)
    source = "rl.engine.num_cpus" if cfg.rl.engine.num_cpus else "this machine's CPUs"
    problems = []
    for stage in chat_trainers():
        section = getattr(cfg, stage)
        layout = section.parallel
        if (
            section.enabled
            and layout.world_size > 1
            and layout.cpus_per_rank is not None
            and layout.world_size * layout.cpus_per_rank > total + 1e-9
        ):
            problems.append(
                f"{stage}.parallel.cpus_per_rank: {layout.world_size} ranks x {layout.cpus_per_rank:g} CPUs "
                f"is more than the local Ray cluster's {total:g} CPUs ({source}); lower it (or unset it: "
                f"each rank gets an equal share), or lower {stage}.parallel.data_parallel_size"
            )
    return problems
