"""Memory per device of a training and rollout layout, estimated before anything runs.

``posttrain validate`` (flows/preflight.py) plans the sft, rm, po and rl stages with this module
and refuses a layout that cannot run: a tensor-parallel size that does not divide the
model, more ranks than the cluster has CPUs (or GPUs), or ranks that need more memory than
they have. ``python -m config.memory_plan`` prints the table of docs/scaling.md. Pure Python
(no torch): it reads only the config and the model's ``config.json`` (and the teacher's). It lives in ``config``
because it is a function of config values that both flows (validate) and engine may use.

The bytes of each role (what each part of a rank costs and the formulas behind them) are
config/memory_estimates.py's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from config.memory_estimates import (
    GIB,
    PROCESS_BYTES,
    ModelShape,
    RoleMemory,
    padded_vocab,
    rollout_role,
    training_role,
)
from config.parallel import ParallelConfig
from config.precision import resolve_precision
from config.stages import chat_trainers

if TYPE_CHECKING:
    from config.schema import PipelineConfig


def _micro(rows: int, budget: int | None, seq_len: int) -> tuple[int, int]:
    """(sequences, tokens) of one micro-batch: ``rows`` sequences of ``seq_len``, or a token
    budget's worth of ``seq_len``-token sequences (at least one)."""
    return (max(1, budget // seq_len), seq_len) if budget else (rows, seq_len)


def plan_stages(
    cfg: PipelineConfig, hf_config: Mapping[str, Any], seq_lens: Mapping[str, int]
) -> dict[str, list[RoleMemory]]:
    """The roles of the training stages in ``seq_lens`` (``sft``, ``rm``, ``po``, ``rl``; when
    enabled) and their bytes.

    Args:
        cfg: the pipeline config (precisions resolved).
        hf_config: the model's ``config.json``.
        seq_lens: tokens per sequence of each stage to plan: sft, rm and po, their longest
            sequence (up to ``<stage>.max_seq_len``); rl, the rollout engine's context, prompt +
            response tokens (the RL engine's ``rollout_len``: the longest prompt +
            ``rl.rollout.max_new_tokens``, capped by the model's context), also the RL
            micro-batches' sequence length.

    The rollout engine's KV cache follows ``rl.rollout.gpu_memory_utilization`` when set (that
    share of ``run.device_memory_gib``, or of host memory without it), else the run's
    sequences (``prompts_per_step x n_samples`` over ``rl.rollout.num_engines``).
    """
    shape = ModelShape.from_hf_config(hf_config)
    rows = padded_vocab(shape.vocab_size, cfg.convert.make_vocab_size_divisible_by)
    plans: dict[str, list[RoleMemory]] = {}
    if cfg.sft.enabled and "sft" in seq_lens:
        b, s = _micro(cfg.sft.micro_batch_size, cfg.sft.max_tokens_per_micro_batch, seq_lens["sft"])
        plans["sft"] = [
            training_role(
                "sft",
                "sft.parallel",
                shape,
                cfg.sft.parallel,
                resolve_precision(cfg.sft.precision),
                b,
                s,
                rows,
                packing=cfg.sft.packing,
                lora=cfg.sft.lora,
            )
        ]
    if cfg.rm.enabled and "rm" in seq_lens:  # a pair is two sequences, chosen and rejected
        b, s = _micro(2 * cfg.rm.micro_batch_size, cfg.rm.max_tokens_per_micro_batch, seq_lens["rm"])
        plans["rm"] = [
            training_role(
                "rm",
                "rm.parallel",
                shape,
                cfg.rm.parallel,
                resolve_precision(cfg.rm.precision),
                b,
                s,
                rows,
                logits=False,
                packing=cfg.rm.packing,
            )
        ]
    if cfg.po.enabled and "po" in seq_lens:
        # a pair is two sequences (an unpaired KTO row of data.kto one); the reference's log-probs
        # are computed by the policy itself before the first step and cached: no second model
        per_example = 1 if cfg.data.kto is not None else 2
        plans["po"] = [
            training_role(
                "po",
                "po.parallel",
                shape,
                cfg.po.parallel,
                resolve_precision(cfg.po.precision),
                per_example * cfg.po.micro_batch_size,
                seq_lens["po"],
                rows,
                lora=cfg.po.lora,
            )
        ]
    if "rl" not in seq_lens:
        return plans
    rollout_tokens = seq_lens["rl"]
    rl, p = cfg.rl, resolve_precision(cfg.rl.precision)  # resolved already in a loaded config
    b, s = _micro(rl.micro_batch_size, rl.max_tokens_per_micro_batch, rollout_tokens)
    roles = [
        training_role(
            "actor",
            "rl.parallel.actor",
            shape,
            rl.parallel.actor,
            p,
            b,
            s,
            rows,
            packing=rl.packing,
            lora=rl.lora,
            peft=rl.backend == "deepspeed",
        )
    ]
    if rl.uses_reference:
        roles.append(
            training_role(
                "reference", "rl.parallel.reference", shape, rl.parallel.reference, p, b, s, rows, trainable=False
            )
        )
    if rl.teacher is not None:  # on-policy distillation: a frozen teacher of its own shape, laid out as the reference
        teacher = teacher_hf_config(rl.teacher.model_dir)
        roles.append(
            training_role(
                "teacher",
                "rl.teacher",
                ModelShape.from_hf_config(teacher),
                rl.parallel.reference,
                resolve_precision(rl.teacher.precision or p),
                b,
                s,
                int(teacher.get("padded_vocab_size", teacher["vocab_size"])),
                trainable=False,
            )
        )
    if rl.algorithm_needs.critic:
        roles.append(
            training_role("critic", "rl.parallel.critic", shape, rl.parallel.critic, p, b, s, rows, logits=False)
        )  # the critic stays padded (rl.packing)
    if rl.uses_reward_model:
        roles.append(
            training_role(
                "reward",
                "rl.parallel.reward_model",
                shape,
                rl.parallel.reward_model,
                p,
                b,
                s,
                rows,
                trainable=False,
                logits=False,
            )
        )
    engines, gpus = rl.rollout.num_engines, rl.rollout.gpus_per_engine
    reserved = None  # vLLM's gpu_memory_utilization: that share of the engine's memory holds weights and KV cache
    if rl.rollout.gpu_memory_utilization is not None:
        memory = (
            gpus * cfg.run.device_memory_gib * GIB if gpus and cfg.run.device_memory_gib else host_memory_bytes() or 0
        )
        reserved = int(rl.rollout.gpu_memory_utilization * memory)
    sequences = math.ceil(rl.prompts_per_step / engines) * rl.n_samples
    roles.append(rollout_role(shape, p, sequences, rollout_tokens, engines, reserved, gpus))
    plans["rl"] = roles
    return plans


def teacher_hf_config(model_dir: str) -> dict[str, Any]:
    """``rl.teacher.model_dir``'s ``hf/config.json``, with ``padded_vocab_size`` from its
    ``megatron_spec.json`` when the model directory has one (the layout of
    ``engine.storage.model_dir``).

    Raises: ValueError naming ``rl.teacher.model_dir`` and the file when it is missing or not JSON.
    """
    config = os.path.join(model_dir, "hf", "config.json")
    try:
        with open(config, encoding="utf-8") as f:
            hf = json.load(f)
        spec = os.path.join(model_dir, "megatron_spec.json")
        if os.path.isfile(spec):
            with open(spec, encoding="utf-8") as f:
                hf["padded_vocab_size"] = json.load(f)["padded_vocab_size"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"rl.teacher.model_dir: cannot read the teacher's model config {config} ({exc})") from exc
    return hf


def host_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """This machine's memory (``MemTotal``, a size fixed by the machine, not its current load),
    in bytes; None where ``meminfo`` cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def local_gpus() -> int:
    """NVIDIA GPUs of this machine, counted from ``/proc/driver/nvidia/gpus`` (0 without a driver)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def tensor_parallel_problems(key: str, shape: ModelShape, tp: int, vocab_rows: int, model: str) -> list[str]:
    """Why ``tp`` tensor-parallel ranks cannot split ``shape`` (empty: they can).

    megatron-core splits the attention heads, the query groups (KV heads), the FFN columns and
    the vocabulary rows evenly across the TP ranks (conversion/tensor_parallel.py), so each of
    ``num_attention_heads``, ``num_key_value_heads``, ``ffn_hidden_size`` and the padded
    vocabulary must be a multiple of ``tp``.
    """
    if tp == 1:
        return []
    sizes = {
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "intermediate_size": shape.ffn_hidden_size,
        "padded vocabulary": vocab_rows,
    }
    bad = [f"{name} {n}" for name, n in sizes.items() if n % tp]
    if not bad:
        return []
    fix = " (pad it further: convert.make_vocab_size_divisible_by)" if "padded vocabulary" in bad[-1] else ""
    return [
        f"{key}.tensor_model_parallel_size={tp} does not divide {', '.join(bad)} of {model}{fix}: megatron-core "
        f"splits each evenly across the tensor-parallel ranks; use a size that divides them"
    ]


def _gpu_key(r: RoleMemory) -> str:
    """The config key of a role's GPUs: ``rl.rollout.gpus_per_engine`` or ``<layout>.gpus_per_rank``."""
    return f"{r.key}.gpus_per_engine" if r.role == "rollout" else f"{r.key}.gpus_per_rank"


def check_plan(
    plans: dict[str, list[RoleMemory]],
    *,
    local: bool,
    cpus: Mapping[str, float],
    gpus: int,
    device_memory_gib: float | None,
    host_bytes: int | None,
    seq_lens: Mapping[str, int] | None = None,
) -> tuple[list[str], list[str]]:
    """Problems (layouts that cannot run) and notes (what each stage needs) of ``plans``.

    Args:
        plans: :func:`plan_stages`'s result.
        local: the Ray cluster is started on this machine (no ``rl.engine.ray_address`` and
            no ``RAY_ADDRESS``): ranks, CPUs, GPUs and host memory are this machine's.
        cpus: per stage, the CPUs its training ranks share on the local cluster.
        gpus: GPUs of this machine.
        device_memory_gib: ``run.device_memory_gib`` (None: GPU ranks are not checked).
        host_bytes: this machine's memory (None: host memory is not checked).
        seq_lens: the stages' sequence lengths, named in the notes.

    Rules: a rank with ``gpus_per_rank > 0`` must fit ``gpus_per_rank x device_memory_gib``.
    On a local cluster the host-memory ranks of a stage must fit this machine's memory
    together (every RL role holds its model for the whole run, colocated or not; each rank is
    also a process of :data:`PROCESS_BYTES`), and a training role's ranks must fit the
    stage's CPUs (``cpus_per_rank`` each, at least one) and this machine's GPUs.
    """
    problems, notes = [], []
    for stage, roles in plans.items():
        tokens = f", sequences of {seq_lens[stage]} tokens" if seq_lens and stage in seq_lens else ""
        notes.append(f"memory plan ({stage}{tokens}): " + "; ".join(r.describe() for r in roles))
        for r in roles:
            if r.gpus_per_rank and device_memory_gib:
                budget = r.gpus_per_rank * device_memory_gib * GIB
                if r.per_rank > budget and r.role == "rollout":
                    problems.append(
                        f"{r.key}: an engine needs about {r.per_rank / GIB:.2f} GiB ({r.describe()}) but "
                        f"has {budget / GIB:.2f} GiB ({_gpu_key(r)} {r.gpus_per_rank:g} x "
                        f"run.device_memory_gib {device_memory_gib:g}); raise {_gpu_key(r)}, lower "
                        "rl.rollout.gpu_memory_utilization, or give each engine fewer sequences "
                        "(rl.prompts_per_step x rl.n_samples over rl.rollout.num_engines; estimates: "
                        "docs/scaling.md)"
                    )
                elif r.per_rank > budget:
                    problems.append(
                        f"{r.key}: a rank needs about {r.per_rank / GIB:.2f} GiB ({r.describe()}) but has "
                        f"{budget / GIB:.2f} GiB ({r.key}.gpus_per_rank {r.gpus_per_rank:g} x "
                        f"run.device_memory_gib {device_memory_gib:g}); raise {r.key}."
                        "tensor_model_parallel_size or gpus_per_rank, or lower the micro-batch "
                        "(estimates: docs/scaling.md)"
                    )
        if any(r.gpus_per_rank for r in roles) and not device_memory_gib:
            notes.append(
                f"memory plan ({stage}): GPU ranks are not checked against device memory; set run.device_memory_gib"
            )
        if not local:
            continue
        host = [r for r in roles if not r.gpus_per_rank]
        need = sum(r.ranks * (r.per_rank + PROCESS_BYTES) for r in host)
        if host and host_bytes and need > host_bytes:
            largest = max(host, key=lambda r: r.ranks * r.per_rank)
            problems.append(
                f"{largest.key}: the {stage} stage's ranks on this machine need about {need / GIB:.2f} GiB "
                f"together ({'; '.join(r.describe() for r in host)}; {PROCESS_BYTES / 2**20:.0f} MiB "
                f"more per rank for its process) but the machine has {host_bytes / GIB:.2f} GiB "
                "(MemTotal); lower the micro-batch or the ranks, or join a cluster of several nodes "
                "(rl.engine.ray_address; estimates: docs/scaling.md)"
            )
        for r in roles:
            if r.role in ("rollout", "reward"):
                continue
            ranks = f"{r.ranks} rank{'s' if r.ranks != 1 else ''}"
            if r.ranks * max(r.cpus_per_rank or 1.0, 1.0) > cpus[stage]:
                each = f" x {r.key}.cpus_per_rank {r.cpus_per_rank:g}" if r.cpus_per_rank else ""
                problems.append(
                    f"{r.key}: {ranks} (data_parallel_size x tensor_model_parallel_size){each} "
                    f"exceed the {cpus[stage]:g} CPUs the local Ray cluster gives the {stage} stage's "
                    "training (rl.engine.num_cpus, else this machine's cores, minus "
                    "rl.engine.rollout_cpus when disaggregated); lower the sizes or join a larger "
                    "cluster (rl.engine.ray_address)"
                )
            if r.gpus_per_rank and r.ranks * r.gpus_per_rank > gpus:
                problems.append(
                    f"{r.key}: {ranks} x {r.key}.gpus_per_rank {r.gpus_per_rank:g} exceed the "
                    f"{gpus} GPU(s) of this machine"
                )
        if stage == "rl":  # its bundles against the nodes: placement_problems
            continue
        users = [r for r in roles if r.gpus_per_rank]
        total = sum(r.ranks * r.gpus_per_rank for r in users)
        alone = len(users) == 1 and users[0].role not in ("rollout", "reward")  # reported above
        if total > gpus and not alone:
            each = " + ".join(f"{r.ranks} x {_gpu_key(r)} {r.gpus_per_rank:g}" for r in users)
            fix = (
                "this machine has no GPU: set them to 0"
                if not gpus
                else "lower the ranks, the GPUs per rank or engine, or rl.rollout.num_engines, or join a larger "
                "cluster (rl.engine.ray_address)"
            )
            problems.append(
                f"{stage}: its roles reserve {total:g} GPUs together ({each}) but this machine has {gpus}; {fix}"
            )
    return problems, notes


def layout_problems(
    cfg: PipelineConfig, hf_config: Mapping[str, Any], model: str, vocab_known: bool = True
) -> list[str]:
    """:func:`tensor_parallel_problems` of every role's layout (``sft.parallel``, ``rm.parallel``,
    ``po.parallel``, ``rl.parallel.<role>``) against ``hf_config``, the model's config.json
    (milliseconds: ``posttrain run`` checks it before the first stage). ``vocab_known`` False:
    the vocabulary is not checked (the prepare step has not trained the tokenizer yet).

    Raises: ValueError naming a config.json key the sizes need."""
    shape = ModelShape.from_hf_config(hf_config if vocab_known else {"vocab_size": 0, **hf_config})
    rows = padded_vocab(shape.vocab_size, cfg.convert.make_vocab_size_divisible_by) if vocab_known else 0
    layouts = {
        f"rl.parallel.{role}": getattr(cfg.rl.parallel, role)
        for role in ("actor", "critic", "reference", "reward_model")
    }
    layouts.update({"sft.parallel": cfg.sft.parallel, "rm.parallel": cfg.rm.parallel, "po.parallel": cfg.po.parallel})
    return [
        p
        for key, layout in layouts.items()
        for p in tensor_parallel_problems(key, shape, layout.tensor_model_parallel_size, rows, model)
    ]


def check_layouts(
    cfg: PipelineConfig,
    hf_config: Mapping[str, Any],
    seq_lens: Mapping[str, int],
    model: str,
    cluster_address: str | None,
) -> tuple[list[str], list[str]]:
    """What ``posttrain validate`` reports of the layouts: (problems, notes).

    Tensor-parallel sizes that do not divide the model (each role's key); then, when they all
    do, :func:`check_plan` on :func:`plan_stages` (``seq_lens`` as there). ``cluster_address`` is the cluster the
    engine joins (``rl.engine.ray_address``, else ``RAY_ADDRESS``; None: a local one, whose
    CPUs are ``rl.engine.num_cpus`` or ``os.cpu_count()``). Never connects to a cluster.
    """
    problems = layout_problems(cfg, hf_config, model)
    if problems:
        return problems, []
    total = float(cfg.rl.engine.num_cpus or os.cpu_count() or 1)
    train = total - cfg.rl.engine.rollout_cpus if cfg.rl.engine.placement == "disaggregated" else total
    return check_plan(
        plan_stages(cfg, hf_config, seq_lens),
        local=cluster_address is None,
        cpus={**dict.fromkeys(chat_trainers(), total), "rl": train},
        gpus=local_gpus(),
        device_memory_gib=cfg.run.device_memory_gib,
        host_bytes=host_memory_bytes(),
        seq_lens=seq_lens,
    )


# ----------------------------------------------------------------------------- the docs table

# The published config.json sizes of three Qwen2.5 models (Hugging Face Qwen/Qwen2.5-0.5B,
# -1.5B, -7B); rank_parameters gives 494,032,768, 1,543,714,304 and 7,615,616,512 for them,
# the parameter counts of their checkpoints.
QWEN25 = {
    "Qwen2.5-0.5B": dict(
        vocab_size=151936,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
    ),
    "Qwen2.5-1.5B": dict(
        vocab_size=151936,
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        tie_word_embeddings=True,
    ),
    "Qwen2.5-7B": dict(
        vocab_size=152064,
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        tie_word_embeddings=False,
    ),
}
TABLE_LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2), (1, 4))  # (data_parallel_size, tensor_model_parallel_size)
TABLE_WORKLOAD: dict[str, Any] = dict(micro_batch=4, seq_len=1024, sequences=256, precision="bf16")


def render_table() -> str:
    """The Markdown tables of docs/scaling.md: per device, the actor and the reference of each
    :data:`QWEN25` model at each of :data:`TABLE_LAYOUTS`, and each model's rollout engine,
    for :data:`TABLE_WORKLOAD` (bf16; megatron's ``local`` attention, no packing)."""
    w = TABLE_WORKLOAD
    lines = [
        "| model | parameters | DP x TP | devices | actor: weights + master + gradients + AdamW | actor: "
        "activations | actor per device | reference per device |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rollout = ["| model | weights | KV cache | rollout engine |", "|---|---|---|---|"]
    for name, hf in QWEN25.items():
        shape = ModelShape.from_hf_config({"architectures": ["Qwen2ForCausalLM"], **hf})
        rows = padded_vocab(shape.vocab_size, 128)
        for dp, tp in TABLE_LAYOUTS:
            head = f"| {name} | {shape.rank_parameters() / 1e9:.2f} B | {dp} x {tp} | {dp * tp} |"
            why = tensor_parallel_problems("tp", shape, tp, rows, name)
            if why:
                bad = why[0].split(" does not divide ", 1)[1].split(" of ", 1)[0]
                lines.append(f"{head} not divisible: {bad} | | | |")
                continue
            layout = ParallelConfig(data_parallel_size=dp, tensor_model_parallel_size=tp)
            actor = training_role("actor", "", shape, layout, w["precision"], w["micro_batch"], w["seq_len"], rows)
            ref = training_role(
                "reference", "", shape, layout, w["precision"], w["micro_batch"], w["seq_len"], rows, trainable=False
            )
            states = actor.per_rank - actor.parts["activations"]
            lines.append(
                f"{head} {states / GIB:.2f} GiB | {actor.parts['activations'] / GIB:.2f} GiB | "
                f"{actor.per_rank / GIB:.2f} GiB | {ref.per_rank / GIB:.2f} GiB |"
            )
        engine = rollout_role(shape, w["precision"], w["sequences"], w["seq_len"])
        rollout.append(
            f"| {name} | {engine.parts['weights'] / GIB:.2f} GiB | {engine.parts['kv_cache'] / GIB:.2f} GiB "
            f"| {engine.per_rank / GIB:.2f} GiB |"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(rollout) + "\n"


if __name__ == "__main__":
    print(render_table(), end="")
