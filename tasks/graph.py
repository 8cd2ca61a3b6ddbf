"""The pipeline DAG: stages in run order and how their fingerprints chain.

A stage's fingerprint covers the *content* hashes of its upstream artifacts (early
cut-off: a byte-identical rebuild upstream changes nothing downstream). So the
fingerprint a stage would have now is known only once each upstream stage has an
artifact for the current config; until then the stage is "waiting" on that upstream
stage (what ``posttrain status`` shows), and its fingerprint is unknown.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from typing import Any

from config import stages as registry
from config.schema import PipelineConfig
from tasks.artifacts import ArtifactCheck, ArtifactRef, ArtifactStore, content_hash
from tasks.pipeline_run import use_pipeline_identity
from tasks.runner import store_for
from tasks.spec import StageSpec


def _implementation(entry: registry.Stage) -> tuple[StageSpec, object]:
    """``(SPEC, Prefect task)`` of a registry stage: ``tasks/<name>.py``'s ``SPEC`` and its
    function ``<name>``. Raises ImportError / ValueError naming the module when either is
    missing or the spec names another stage."""
    # By name: the registry (config/stages.py) names the stage, tasks/<name>.py implements it.
    # Nothing a stage module imports reaches back to this module (tests/test_structure.py).
    module = importlib.import_module(f"tasks.{entry.name}")
    spec, task = getattr(module, "SPEC", None), getattr(module, entry.name, None)
    if not isinstance(spec, StageSpec) or task is None:
        raise ImportError(
            f"tasks/{entry.name}.py: stage {entry.name!r} (config/stages.py) needs a StageSpec `SPEC` "
            f"and its Prefect task `{entry.name}`"
        )
    if spec.name != entry.name:
        raise ValueError(
            f"tasks/{entry.name}.py: SPEC.name is {spec.name!r}, not the stage's name {entry.name!r} (config/stages.py)"
        )
    return spec, task


# (spec, Prefect task) of each config.stages entry, in its (topological) order.
STAGES = [_implementation(entry) for entry in registry.STAGES]
STAGE_NAMES = [spec.name for spec, _ in STAGES]


def enabled_stages(cfg: PipelineConfig) -> list[tuple[StageSpec, object]]:
    """Stages this config runs (a stage with a switch, ``config.stages.Stage.switch``: sft, rm
    and po, only when ``<stage>.enabled``)."""
    return [(s, t) for s, t in STAGES if registry.is_enabled(cfg, s.name)]


def stage(name: str) -> tuple[StageSpec, Any]:  # (spec, its Prefect task)
    for s, t in STAGES:
        if s.name == name:
            return s, t
    raise KeyError(f"unknown stage {name!r}; stages are: {', '.join(STAGE_NAMES)} (and prepare)")


@dataclass(frozen=True)
class StageState:
    """Where one stage stands for a config.

    fingerprint: what the stage's fingerprint is now; None while ``waiting_on`` is set.
    check: the store's check of that fingerprint's artifact (state published / missing /
        broken, the problem, the manifest); None while waiting.
    waiting_on: the nearest upstream stage that has no usable artifact for this config,
        so this stage's inputs (and fingerprint) are not known yet.
    """

    name: str
    fingerprint: str | None
    check: ArtifactCheck | None
    waiting_on: str | None

    @property
    def ref(self) -> ArtifactRef | None:
        """The published artifact of the current fingerprint (passes the check), or None."""
        return self.check.ref if self.check is not None and self.check.state == "published" else None

    @property
    def content_hash(self) -> str | None:
        """The content hash downstream fingerprints use: the published artifact's, or what a
        broken one's manifest records (its rebuild normally restores the same bytes)."""
        if self.ref is not None:
            return self.ref.content_hash
        manifest: dict[str, Any] | None = self.check.manifest if self.check is not None else None
        if manifest and isinstance(manifest.get("files"), list):
            return manifest.get("content_hash") or content_hash(manifest["files"])
        return None


def stage_states(
    cfg: PipelineConfig, store: ArtifactStore | None = None, verify: bool = False
) -> dict[str, StageState]:
    """Each enabled stage's :class:`StageState`, in run order. ``verify`` re-hashes every
    file of each current artifact (otherwise files are checked for presence and size)."""
    store = store or store_for(cfg)
    states: dict[str, StageState] = {}
    for spec, _ in enabled_stages(cfg):
        ups = spec.inputs(cfg)
        waiting = next((u for u in ups if states[u].content_hash is None), None)
        if waiting is not None:
            states[spec.name] = StageState(spec.name, None, None, waiting)
            continue
        fp = spec.fingerprint(
            cfg, {u: h for u in ups if (h := states[u].content_hash) is not None}
        )  # every one: not waiting
        states[spec.name] = StageState(spec.name, fp, store.check(spec.name, fp, verify=verify), None)
    return states


def expected_fingerprints(cfg: PipelineConfig) -> dict[str, str | None]:
    """Fingerprint each enabled stage has now, in run order (None: waiting on an upstream stage)."""
    return {name: s.fingerprint for name, s in stage_states(cfg).items()}


def pipeline_identity(cfg: PipelineConfig) -> str:
    """64 hex digits naming the pipeline this config describes, computable before any stage
    has run (every process of a pipeline run, and every later run of the same pipeline,
    gets the same value; W&B groups a pipeline's stage runs by it).

    A stage's fingerprint chains on the content hashes of its upstream artifacts, which
    are known only once those are built, so the identity is taken from what the config and
    the files on disk give up front: for each enabled stage in run order, its name, its
    upstream stage names and its *recipe*, ``StageSpec.fingerprint(cfg, {})``: the sha256
    of the stage name, the content hashes of its raw inputs (``StageSpec.raw_hashes``),
    its fingerprinted config slice (``StageSpec.config``, raw input paths replaced by
    their content) and its code version (``tasks.fingerprint.code_version``). So a
    changed parameter of any stage, a changed dataset file, model or reward plug-in, or
    changed stage code gives a new identity; what the fingerprints leave out (``run.name``,
    ``run.artifact_root``, ``run.checkpoint_root``, ``wandb.*``, logging and checkpoint cadence, engine placement) and how a raw input's
    path is spelled do not. Since the upstream artifacts enter only through the recipes
    that produce them, a non-deterministic stage (rl) rebuilt under the same config keeps
    the identity.

    identity = sha256(canonical JSON of [{stage, inputs, recipe} for each enabled stage])
    """
    recipes = [
        {"stage": spec.name, "inputs": list(spec.inputs(cfg)), "recipe": spec.fingerprint(cfg, {})}
        for spec, _ in enabled_stages(cfg)
    ]
    return hashlib.sha256(json.dumps(recipes, sort_keys=True).encode()).hexdigest()


# Stage runs report the identity (their W&B group, their manifests' ``pipeline_run``); it is
# handed to tasks.pipeline_run rather than imported there, which would make a circle of imports
# (pipeline_run -> graph -> each stage module -> runner -> tracking -> pipeline_run).
use_pipeline_identity(pipeline_identity)
