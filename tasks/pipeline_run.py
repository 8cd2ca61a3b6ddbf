"""Which pipeline run a stage belongs to, and what its W&B run is grouped, tagged and
configured with (tasks/tracking.py starts the runs; the module docstring there says why):
the pipeline identity (``tasks.graph.pipeline_identity``, handed in by :func:`use_pipeline_identity`)
and its W&B group, the Prefect flow run and deployment, the DVC experiment, the upstream
artifacts of a stage and the flat config of its run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from config.schema import PipelineConfig
from config.stages import STAGES
from tasks.artifacts import ArtifactError, ArtifactRef, ArtifactStore

_TAG_MAX = 64  # W&B's limit on a tag's length

# The YAML sections that make each stage's result (what a run of the stage reports as config).
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {s.name: s.sections for s in STAGES}  # in run order (config.stages)

_identities: dict[tuple[str, str], str] = {}  # (flow run id, config) -> pipeline identity
_identity_of: Callable[[PipelineConfig], str] | None = None  # set by tasks.graph (use_pipeline_identity)
_deployments: dict[str, str | None] = {}  # flow run id -> deployment name


def flatten(value: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"rl": {"optim": {"lr": 1e-4}}}`` -> ``{"rl.optim.lr": 1e-4}``: nested dicts become
    dotted keys; lists and scalars are kept as values."""
    flat: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, dict) and item:
            flat.update(flatten(item, f"{name}."))
        else:
            flat[name] = item
    return flat


def _prefect_run() -> tuple[str | None, str | None]:
    """(flow run id, deployment name) of the Prefect flow run this code runs in, or None."""
    # Prefect's runtime: `posttrain validate` imports this module (wandb_mode) without Prefect
    from prefect.context import FlowRunContext
    from prefect.runtime import flow_run

    run_id = flow_run.get_id()
    if run_id in _deployments:
        return run_id, _deployments[run_id]
    ctx = FlowRunContext.get()
    deployment_id = getattr(getattr(ctx, "flow_run", None), "deployment_id", None)
    name = None
    if deployment_id is not None:
        try:
            # Prefect's runtime: `posttrain validate` imports this module (wandb_mode) without Prefect
            from prefect.runtime import deployment

            name = deployment.name
        except Exception:  # the API is out of reach: the id still names it
            name = str(deployment_id)
    if run_id:
        _deployments[run_id] = name
    return run_id, name


def use_pipeline_identity(identity_of: Callable[[PipelineConfig], str]) -> None:
    """Set how a config's pipeline identity is computed: ``tasks.graph`` hands in its
    ``pipeline_identity`` when it is imported. Passed in, not imported: the identity covers
    every stage, so it needs every stage module, and the stage modules run their stage
    through ``tasks.runner``, which imports this module; importing ``tasks.graph`` here would
    close that circle."""
    global _identity_of
    _identity_of = identity_of


def _identity(cfg: PipelineConfig, flow_run_id: str | None) -> str:
    """``tasks.graph.pipeline_identity(cfg)`` (:func:`use_pipeline_identity`), computed once
    per Prefect flow run when ``flow_run_id`` is given (all stages of one ``posttrain run``
    share it, even if a raw input is rewritten meanwhile).

    Raises:
        RuntimeError: ``tasks.graph`` was not imported in this process (every way to run a
            stage, ``flows.pipeline`` and the CLI, takes its task from there).
    """
    key = (flow_run_id or "", cfg.model_dump_json())
    if flow_run_id and key in _identities:
        return _identities[key]
    if _identity_of is None:
        raise RuntimeError(
            "the pipeline identity is unknown in this process: import tasks.graph first (it hands "
            "tasks.pipeline_run its pipeline_identity; flows.pipeline and the CLI do)"
        )
    identity = _identity_of(cfg)
    if flow_run_id:
        _identities[key] = identity
    return identity


def pipeline_group(cfg: PipelineConfig, identity: str) -> str:
    """The W&B group of a pipeline: ``<run.name>-<identity[:12]>``."""
    return f"{cfg.run.name}-{identity[:12]}"


def pipeline_run_info(cfg: PipelineConfig) -> dict[str, str | None]:
    """Which pipeline run this is (recorded in each artifact's manifest as ``pipeline_run``):
    ``group`` (:func:`pipeline_group`), ``identity`` (64 hex digits), ``flow_run_id`` and
    ``deployment`` (Prefect; None outside a flow run / for an unscheduled run) and
    ``dvc_experiment`` (``DVC_EXP_NAME``; None outside ``dvc exp run``)."""
    flow_run_id, deployment = _prefect_run()
    identity = _identity(cfg, flow_run_id)
    return {
        "group": pipeline_group(cfg, identity),
        "identity": identity,
        "flow_run_id": flow_run_id,
        "deployment": deployment,
        "dvc_experiment": os.environ.get("DVC_EXP_NAME") or None,
    }


def run_tags(info: dict[str, str | None], *extra: str) -> list[str]:
    """W&B tags of a stage run: ``extra``, then ``flow-run:<id>``, ``deployment:<name>`` and
    ``dvc-exp:<name>`` where :func:`pipeline_run_info` has them (each cut to 64 characters)."""
    tags = list(extra)
    for prefix, key in (("flow-run", "flow_run_id"), ("deployment", "deployment"), ("dvc-exp", "dvc_experiment")):
        if info.get(key):
            tags.append(f"{prefix}:{info[key]}")
    return [t[:_TAG_MAX] for t in tags]


def upstream_artifacts(store: ArtifactStore | None, inputs: dict[str, ArtifactRef]) -> dict[str, str]:
    """Stage -> artifact id of every artifact upstream of ``inputs``: the inputs themselves
    and, through their manifests' ``inputs``, the artifacts they were built from,
    transitively (nearest first). A manifest that cannot be read ends that branch."""
    found: dict[str, str] = {}
    todo = list(inputs.values())
    while todo:
        ref = todo.pop(0)
        if ref.stage in found:
            continue
        found[ref.stage] = ref.artifact_id
        if store is None:
            continue
        try:
            manifest = store.manifest(ref)
        except (ArtifactError, OSError):
            continue
        for value in (manifest.get("inputs") or {}).values():
            try:
                todo.append(ArtifactRef.model_validate(value))
            except ValueError:
                continue
    return found


def stage_run_config(
    cfg: PipelineConfig, stage: str, artifact_id: str, fingerprint: str | None, upstream: dict[str, str]
) -> dict[str, Any]:
    """The flat W&B config of a stage run: ``artifact_id``, ``fingerprint``, ``run.*``, the
    YAML sections (:data:`STAGE_SECTIONS`) of ``stage`` and of every stage in ``upstream``
    (stage -> artifact id, see :func:`upstream_artifacts`), each key named as in the YAML
    (``rl.optim.lr``), and ``upstream/<stage>/artifact_id``."""
    config: dict[str, Any] = {"artifact_id": artifact_id, "fingerprint": fingerprint}
    config.update(flatten({"run": cfg.run.model_dump(mode="json")}))
    for name in [*(s for s in STAGE_SECTIONS if s in upstream and s != stage), stage]:
        for section in STAGE_SECTIONS.get(name, ()):
            config.update(flatten({section: getattr(cfg, section).model_dump(mode="json")}))
    config.update({f"upstream/{name}/artifact_id": aid for name, aid in upstream.items()})
    return config
