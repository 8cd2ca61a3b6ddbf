"""Checks every command makes before a stage starts, beside ``flows.preflight.check_inputs``:
that W&B online has an API key (:func:`check_wandb_key`), and the cheap model checks of
``posttrain validate`` that ``posttrain run`` makes too (:func:`check_model_fit`; the model
directory's weights are checked by ``check_inputs``), and that the ``code`` verifier's sandbox
has no network (:func:`check_code_sandbox`). Each
problem is one string naming the config key first."""

from __future__ import annotations

import json
import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from config.memory_plan import layout_problems
from config.schema import PipelineConfig
from flows.content_checks import architecture_problem
from flows.model_checks import ModelFacts, check_model, made_by_prepare, no_room, planned_config
from flows.preflight import _prepared
from tasks.fingerprint import declared_data_files, user_modules
from tasks.plugin_files import plugin_paths


def check_wandb_key(cfg: PipelineConfig) -> list[str]:
    """W&B online without an API key fails the first stage that logs; say so before any runs.
    The key is where the W&B client looks: ``WANDB_API_KEY``, else the netrc entry of the W&B
    host (``WANDB_BASE_URL``, default api.wandb.ai) that ``wandb login`` writes."""
    # fsspec (via tasks.tracking): ~0.1 s to import; only artifact stores need it
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
    return [
        f"wandb.mode: {source} needs a W&B API key and none was found (WANDB_API_KEY, or {host} in ~/.netrc): "
        "run `wandb login`, set WANDB_API_KEY, or use wandb.mode: offline and `wandb sync` later"
    ]


def check_model_fit(cfg: PipelineConfig) -> list[str]:
    """The cheap part of :func:`check_contents`, which ``posttrain run`` runs before the first
    stage: the model's config.json (or what the prepare section will build): an architecture
    the convert stage cannot map (``flows.content_checks.architecture_problem``), then the
    lengths and the rollout backend: ``{sft,rm,po}.max_seq_len`` and the response budgets
    against the context, head_dim against vLLM on CPU, the special ids against the
    vocabulary, each role's tensor-parallel size against the heads, KV heads, FFN width and
    vocabulary. Reads no data, no tokenizer and no weights (milliseconds), so a later stage
    does not fail on what the config already says. Returns problems, each naming its key."""
    src, problems = cfg.model.source, []
    if made_by_prepare(cfg, src) and not (cfg.prepare is not None and _prepared(cfg, [])):
        p = cfg.prepare
        if getattr(p, "kind", None) != "addition":
            return []
        m, vocab_known = ModelFacts(src, planned_config(p)), False
    else:
        config = Path(src) / "config.json"
        if not config.is_file():
            return []  # a hub id or a GGUF file: the convert stage reads it; validate reads GGUF metadata
        try:  # json, not conversion.hf_source: a cached run must not pay for importing torch
            m = ModelFacts(src, json.loads(config.read_text()))
        except (ValueError, OSError):
            return []  # validate and the convert stage report an unreadable config, with the reason
        if not isinstance(m.config, dict):
            return []
        vocab_known = True
        arch = architecture_problem(src, m.config)  # convert would refuse it, after the prepare stage
        problems += [arch] if arch else []
    try:
        layouts = layout_problems(cfg, m.config, m.name, vocab_known)
    except (ValueError, TypeError):
        layouts = []  # a config.json without the sizes: validate's memory plan says so in a note
    return problems + check_model(cfg, m) + no_room(cfg, m) + layouts


_PLUGIN_KEYS = {"environment": "rl.environment", "algorithm": "rl.algorithm", "policy_loss": "rl.policy_loss"}


def check_plugin_tracking(cfg: PipelineConfig) -> tuple[list[str], list[str]]:
    """What the rl fingerprint tracks of each plug-in (tasks.plugin_files): problems for a
    ``DATA_FILES`` that is not a literal list of strings or names a file that does not
    exist, and one note per configured plug-in saying how many source and declared data
    files enter the fingerprint and, loudly, that a data file it reads without declaring it
    in ``DATA_FILES`` is not tracked. Reads source files only; imports nothing of the user's.
    Returns (problems, notes), each naming its config key."""
    problems, notes = [], []
    for key, path in plugin_paths(cfg).items():
        name = _PLUGIN_KEYS.get(key) or f"rl.reward.functions[{key.rsplit('_', 1)[1]}].path"
        modules = user_modules(path.partition(":")[0])
        data = []
        for file in modules.values():
            try:
                declared = declared_data_files(file)
            except (ValueError, SyntaxError) as exc:
                problems.append(f"{name}: {exc}")
                continue
            for entry, data_path in declared:
                data.append(data_path)
                if not data_path.exists():
                    problems.append(
                        f"{name}: {file} declares DATA_FILES entry {entry!r}, which does not exist ({data_path})"
                    )
        if modules:
            notes.append(
                f"{name} ({path}): the rl fingerprint tracks {len(modules)} source file(s) and {len(data)} declared "
                "data file(s); a data file the plug-in reads that is NOT listed in a DATA_FILES of its modules is "
                "NOT tracked: editing it reuses the cached rl artifact (docs/concepts.md, Plug-ins and the cache)"
            )
    return problems, notes


def code_verifier_keys(cfg: PipelineConfig) -> list[str]:
    """The config keys that name the ``code`` verifier (``rl.reward.verifier``, a
    ``data.rl_train[i].verifier``, an ``evaluate.datasets[i].verifier``)."""
    keys = ["rl.reward.verifier"] if cfg.rl.reward.verifier == "code" else []
    sources = cfg.data.rl_train if isinstance(cfg.data.rl_train, list) else []
    keys += [f"data.rl_train[{i}].verifier" for i, s in enumerate(sources) if s.verifier == "code"]
    keys += [f"evaluate.datasets[{i}].verifier" for i, b in enumerate(cfg.evaluate.datasets) if b.verifier == "code"]
    return keys


def check_code_sandbox(cfg: PipelineConfig) -> list[str]:
    """The ``code`` verifier runs model-written programs: refuse where its sandbox cannot cut
    them off from the network (``data.sandbox.network_isolation_problem``), unless
    ``rl.reward.code.allow_network`` is true. Probes the machine once (about 0.1 s) and only
    when a key names the ``code`` verifier."""
    keys = code_verifier_keys(cfg)
    if not keys or cfg.rl.reward.code.allow_network:
        return []
    # looked up at each call: tests replace data.sandbox.network_isolation_problem
    from data.sandbox import network_isolation_problem

    why = network_isolation_problem()
    if why is None:
        return []
    return [
        f"{keys[0]}: the code verifier runs model-written programs, and this machine's sandbox cannot cut them off "
        f"from the network ({why}); run where unshare can make a network namespace, or set "
        "rl.reward.code.allow_network: true to run them with network access"
    ]
