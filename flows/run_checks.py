"""Checks every command makes before a stage starts, beside ``flows.preflight.check_inputs``:
that W&B online has an API key (:func:`check_wandb_key`), the CPUs the sft, rm and po
stages' ranks ask for (:func:`check_stage_cpus`), and the cheap model checks of
``posttrain validate`` that ``posttrain run`` makes too (:func:`check_model_fit`). Each
problem is one string naming the config key first."""

from __future__ import annotations

import json
import os
from pathlib import Path

from config.schema import PipelineConfig
from config.memory_plan import layout_problems
from flows.preflight import _check_model, _made_by_prepare, _Model, _no_room, _prepared, cluster_address, planned_config


def check_wandb_key(cfg: PipelineConfig) -> list[str]:
    """W&B online without an API key fails the first stage that logs; say so before any runs.
    The key is where the W&B client looks: ``WANDB_API_KEY``, else the netrc entry of the W&B
    host (``WANDB_BASE_URL``, default api.wandb.ai) that ``wandb login`` writes."""
    import netrc
    from urllib.parse import urlparse

    from tasks.tracking import wandb_mode

    if wandb_mode(cfg) != "online" or os.environ.get("WANDB_API_KEY"):
        return []
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return []
    except (OSError, netrc.NetrcParseError):
        pass  # no netrc file (or an unreadable one): no key there
    source = "WANDB_MODE=online" if os.environ.get("WANDB_MODE") else "wandb.mode: online"
    return [f"wandb.mode: {source} needs a W&B API key and none was found (WANDB_API_KEY, or {host} in ~/.netrc): "
            "run `wandb login`, set WANDB_API_KEY, or use wandb.mode: offline and `wandb sync` later"]


def check_model_fit(cfg: PipelineConfig) -> list[str]:
    """The cheap part of :func:`check_contents`, which ``posttrain run`` runs before the first
    stage: the model's config.json (or what the prepare section will build) against the
    lengths and the rollout backend: ``{sft,rm,po}.max_seq_len`` and the response budgets
    against the context, head_dim against vLLM on CPU, the special ids against the
    vocabulary, each role's tensor-parallel size against the heads, KV heads, FFN width and
    vocabulary. Reads no data, no tokenizer and no weights (milliseconds), so a later stage
    does not fail on what the config already says. Returns problems, each naming its key."""
    src = cfg.model.source
    if _made_by_prepare(cfg, src) and not (cfg.prepare is not None and _prepared(cfg, [])):
        p = cfg.prepare
        if getattr(p, "kind", None) != "addition":
            return []
        m, vocab_known = _Model(src, planned_config(p)), False
    else:
        config = Path(src) / "config.json"
        if not config.is_file():
            return []  # a hub id or a GGUF file: the convert stage reads it; validate reads GGUF metadata
        try:  # json, not conversion.hf_source: a cached run must not pay for importing torch
            m = _Model(src, json.loads(config.read_text()))
        except (ValueError, OSError):
            return []  # validate and the convert stage report an unreadable config, with the reason
        if not isinstance(m.config, dict):
            return []
        vocab_known = True
    try:
        layouts = layout_problems(cfg, m.config, m.name, vocab_known)
    except (ValueError, TypeError):
        layouts = []  # a config.json without the sizes: validate's memory plan says so in a note
    return _check_model(cfg, m) + _no_room(cfg, m) + layouts


def check_stage_cpus(cfg: PipelineConfig) -> list[str]:
    """The ranks of the sft, rm and po stages (those enabled, with ``<stage>.parallel`` of more
    than one rank and ``cpus_per_rank`` set) against the CPUs of the local Ray cluster they
    start (``rl.engine.num_cpus``, else this machine's), which the stage would otherwise
    refuse only when it starts (``engine.distributed.stage_group.run_stage``). A cluster that
    is joined (``rl.engine.ray_address``, ``RAY_ADDRESS``) is not checked: its size is known
    only once joined. Returns problems, each naming its key."""
    if cluster_address(cfg) is not None:
        return []
    total = float(cfg.rl.engine.num_cpus or os.cpu_count() or 1)
    source = "rl.engine.num_cpus" if cfg.rl.engine.num_cpus else "this machine's CPUs"
    problems = []
    for stage in ("sft", "rm", "po"):
        section = getattr(cfg, stage)
        layout = section.parallel
        if section.enabled and layout.world_size > 1 and layout.cpus_per_rank is not None \
                and layout.world_size * layout.cpus_per_rank > total + 1e-9:
            problems.append(f"{stage}.parallel.cpus_per_rank: {layout.world_size} ranks x {layout.cpus_per_rank:g} CPUs "
                            f"is more than the local Ray cluster's {total:g} CPUs ({source}); lower it (or unset it: "
                            f"each rank gets an equal share), or lower {stage}.parallel.data_parallel_size")
    return problems
