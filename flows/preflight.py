"""Checks a config's inputs exist before anything runs (``posttrain validate``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from config.schema import PipelineConfig

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _made_by_prepare(cfg: PipelineConfig, path: str) -> bool:
    if cfg.prepare is None:
        return False
    out = Path(cfg.prepare.output_dir).resolve()
    return out == Path(path).resolve() or out in Path(path).resolve().parents


def check_inputs(cfg: PipelineConfig) -> tuple[list[str], list[str]]:
    """Returns (problems, notes). Problems name the config key and the missing path."""
    problems, notes = [], []
    for name in ("sft", "preference", "rl_train", "rl_eval"):
        ds = getattr(cfg.data, name)
        if ds is None:
            continue
        if _made_by_prepare(cfg, ds.path):
            notes.append(f"data.{name}.path: {ds.path} is created by the prepare step")
        elif not Path(ds.path).is_file():
            problems.append(f"data.{name}.path: file not found: {ds.path}")
    for key in ("sft", "rl_train", "rl_eval"):
        if getattr(cfg.data, key) is None and (key != "sft" or cfg.sft.enabled):
            needs = "the sft stage (or set sft.enabled: false)" if key == "sft" else "the rl/evaluate stages"
            problems.append(f"data.{key}: required by {needs} but not set")
    if cfg.rm.enabled and cfg.data.preference is None:
        problems.append("data.preference: required when rm.enabled is true (set rm.enabled: false to skip the reward model)")
    if cfg.rl.reward.verifier == "none":
        problems.append("rl.reward.verifier: 'none' leaves the evaluate stage nothing to score with; "
                        "set a verifier (it is also the rl reward unless rl.reward.verifier_weight is 0)")
    if cfg.rl.reward.reward_model_weight and not cfg.rm.enabled:
        problems.append("rl.reward.reward_model_weight: needs rm.enabled: true")
    src = cfg.model.source
    if _made_by_prepare(cfg, src):
        notes.append(f"model.source: {src} is created by the prepare step")
    elif Path(src).exists():
        if Path(src).is_dir() and not (Path(src) / "config.json").is_file():
            problems.append(f"model.source: {src} has no config.json (not an HF model directory)")
    elif src.endswith(".gguf"):
        problems.append(f"model.source: GGUF file not found: {src}")
    elif HUB_ID.match(src):
        notes.append(f"model.source: {src} will be downloaded from the Hugging Face hub")
    else:
        problems.append(f"model.source: not a file, directory or hub id: {src}")
    if cfg.model.tokenizer and not Path(cfg.model.tokenizer).exists() and not _made_by_prepare(cfg, cfg.model.tokenizer):
        problems.append(f"model.tokenizer: directory not found: {cfg.model.tokenizer}")
    problems += _unwritable(cfg.run.artifact_root, "run.artifact_root") + _unwritable(cfg.run.checkpoint_root, "run.checkpoint_root")
    return problems, notes


def _unwritable(root: str, key: str) -> list[str]:
    """A real create-and-remove probe (``os.access`` says yes to root even on read-only dirs)."""
    if "://" in root and not root.startswith("file://"):
        return []  # remote stores: credentials and buckets are checked when the stage publishes
    path = Path(root.removeprefix("file://"))
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    probe = (existing or Path(".")) / f".posttrain-write-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return [f"{key}: cannot write under {path} ({exc.strerror})"]
    return []
