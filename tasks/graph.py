"""The pipeline DAG: stages in run order and how their fingerprints chain.

Fingerprints depend only on config, code and raw input files, never on outputs, so the
expected fingerprint of every stage can be computed without running anything (what
``posttrain status`` compares against the published artifacts).
"""

from __future__ import annotations

from config.schema import PipelineConfig
from tasks import convert, evaluate, export, rl, rm, sft, validate
from tasks.runner import StageSpec

# (spec, Prefect task) in topological order.
STAGES = [
    (validate.SPEC, validate.validate),
    (convert.SPEC, convert.convert),
    (sft.SPEC, sft.sft),
    (rm.SPEC, rm.rm),
    (rl.SPEC, rl.rl),
    (evaluate.SPEC, evaluate.evaluate),
    (export.SPEC, export.export),
]
STAGE_NAMES = [spec.name for spec, _ in STAGES]


def enabled_stages(cfg: PipelineConfig) -> list[tuple[StageSpec, object]]:
    """Stages this config runs (sft only when ``sft.enabled``, rm only when ``rm.enabled``)."""
    switch = {"sft": cfg.sft.enabled, "rm": cfg.rm.enabled}
    return [(s, t) for s, t in STAGES if switch.get(s.name, True)]


def stage(name: str) -> tuple[StageSpec, object]:
    for s, t in STAGES:
        if s.name == name:
            return s, t
    raise KeyError(f"unknown stage {name!r}; stages are: {', '.join(STAGE_NAMES)} (and prepare)")


def expected_fingerprints(cfg: PipelineConfig) -> dict[str, str]:
    """Fingerprint each enabled stage would have now, in run order."""
    fps: dict[str, str] = {}
    for spec, _ in enabled_stages(cfg):
        fps[spec.name] = spec.fingerprint(cfg, {n: fps[n] for n in spec.inputs(cfg)})
    return fps
