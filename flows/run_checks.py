"""Checks every command makes before a stage starts, beside ``flows.preflight.check_inputs``:
that W&B online has an API key (:func:`check_wandb_key`), and the cheap model checks of
``posttrain validate`` that ``posttrain run`` makes too (:func:`check_model_fit`; the model
directory's weights are checked by ``check_inputs``). Each
problem is one string naming the config key first."""

from __future__ import annotations

import json
import os
from pathlib import Path

from config.schema import PipelineConfig
from flows.content_checks import architecture_problem
from flows.preflight import _check_model, _made_by_prepare, _Model, _no_room, _prepared


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
    stage: the model's config.json (or what the prepare section will build): an architecture
    the convert stage cannot map (``flows.content_checks.architecture_problem``), then the
    lengths and the rollout backend: ``{sft,rm,po}.max_seq_len`` and the response budgets
    against the context, head_dim against vLLM on CPU, the special ids against the
    vocabulary. Reads no data, no tokenizer and no weights (milliseconds), so a later stage
    does not fail on what the config already says. Returns problems, each naming its key."""
    src, problems = cfg.model.source, []
    if _made_by_prepare(cfg, src) and not (cfg.prepare is not None and _prepared(cfg, [])):
        p = cfg.prepare
        if getattr(p, "kind", None) != "addition":
            return []
        m = _Model(src, {"hidden_size": p.hidden_size, "num_attention_heads": p.num_attention_heads,
                         "max_position_embeddings": p.max_position_embeddings})
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
        arch = architecture_problem(src, m.config)  # convert would refuse it, after the prepare stage
        problems += [arch] if arch else []
    return problems + _check_model(cfg, m) + _no_room(cfg, m)
