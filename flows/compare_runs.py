"""The runs ``posttrain compare`` sets side by side (flows/compare.py), resolved from its
arguments: a config file (its artifacts found by fingerprint, as ``posttrain status`` finds
them), an artifact id or directory (the artifacts it was built from and the newest built from
it), or a DVC experiment name (its commit's params file and pointer files). Each becomes a
:class:`Run`: the manifests of its stages and the inputs each stage was built from.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from config import ConfigError, load_config
from config.stages import stage_names
from tasks.fingerprint import code_version

if TYPE_CHECKING:
    from config.schema import PipelineConfig
    from tasks.artifacts import ArtifactRef, ArtifactStore
    from tasks.spec import StageSpec

# tasks.* (Prefect and every stage module) is imported where it is used: the `posttrain`
# command registers compare's arguments on every start, and `validate` stays fast.
STAGE_NAMES = stage_names()  # config.stages, the order of tasks.graph.STAGE_NAMES
ARTIFACT_ID = re.compile(rf"({'|'.join(STAGE_NAMES)})-[0-9a-f]{{16}}")

# Stage config slices that are one config section dumped bare (tasks/<stage>.py SPEC.config):
# their keys are shown under the section's name, as in the YAML file.
_BARE_SECTION = {"validate": "data", "export": "export"}


class CompareError(ConfigError):
    """A run that cannot be resolved (unknown file, artifact or experiment); names which."""


@dataclass
class Run:
    """One pipeline run being compared.

    label: the argument as given. kind: ``config``, ``artifact`` or ``experiment``.
    refs, manifests: stage -> its published artifact and manifest (stages without one are absent).
    inputs: stage -> what enters the stage's fingerprint, flat: config keys (dotted, as in
        the YAML file), ``input <stage>`` (upstream artifact ids), ``file <key>`` (raw input
        sha256) and ``code version``.
    notes: what the resolution had to guess or could not find.
    """

    label: str
    kind: str
    store: ArtifactStore
    refs: dict[str, ArtifactRef] = field(default_factory=dict)
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, manifest: dict[str, Any]) -> None:
        """Record a published artifact's manifest (and its ref) under its stage."""
        stage = manifest["stage"]
        ref = self.store.find(stage, manifest["fingerprint"])
        if ref is None:
            self.notes.append(f"{manifest['artifact_id']} is not (or no longer completely) in {self.store.root}")
            return
        self.refs[stage], self.manifests[stage] = ref, manifest
        self.inputs[stage] = stage_inputs(stage, manifest)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one mapping of dotted keys (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``);
    lists and scalars are leaves."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def stage_inputs(stage: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """What entered a stage's fingerprint, from its manifest, flat (see :class:`Run`)."""
    config = manifest.get("config", {})
    if stage in _BARE_SECTION:
        config = {_BARE_SECTION[stage]: config}
    raw = manifest.get("raw_inputs", {})
    # A raw input enters the fingerprint by its content, not its path (tasks.spec.StageSpec):
    # the path stands for "file <key>", whose sha256 is compared below.
    by_path = {v.get("path"): f"(file {k})" for k, v in raw.items()}
    out = {
        ("run.seed" if k == "seed" else k): (by_path.get(v, v) if isinstance(v, str) else v)
        for k, v in flatten(config).items()
    }
    for up, ref in sorted(manifest.get("inputs", {}).items()):
        # Fingerprints chain on the content hash: an upstream artifact of the same id can
        # hold other bytes when it was rebuilt elsewhere.
        out[f"input {up}"] = ref.get("artifact_id")
        out[f"input {up} content"] = ref.get("content_hash")
    out.update({f"file {k}": v.get("sha256") for k, v in sorted(raw.items())})
    out["code version"] = manifest.get("code_version")
    return out


# --- resolving each argument --------------------------------------------------------------


def _read_manifest(store: ArtifactStore, stage: str, artifact_id: str) -> dict[str, Any] | None:
    try:
        with store.fs.open(f"{store.base}/{stage}/{artifact_id}/manifest.json", "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def from_config(label: str, cfg: PipelineConfig) -> Run:
    """The artifacts of ``cfg``'s current fingerprints (``tasks.graph.stage_states``); a
    stage without one keeps the config slice its fingerprint would use."""
    # prefect (via tasks.graph, tasks.runner): 1-2 s to import; only flows and stage runs need it
    from tasks.graph import enabled_stages, stage_states
    from tasks.runner import store_for

    run = Run(label, "config", store_for(cfg))
    states = stage_states(cfg, run.store)
    for spec, _ in enabled_stages(cfg):
        state = states[spec.name]
        if state.ref is not None:
            assert state.check is not None and state.check.manifest is not None  # published: checked, manifest read
            run.add(state.check.manifest)
        else:
            run.inputs[spec.name] = _unbuilt_inputs(spec, cfg)
            why = (
                f"waits on {state.waiting_on}"
                if state.waiting_on
                else f"has no artifact for fingerprint {(state.fingerprint or '')[:16]}"
            )
            run.notes.append(f"{spec.name} {why}")
    return run


def _unbuilt_inputs(spec: StageSpec, cfg: PipelineConfig) -> dict[str, Any]:
    """:func:`stage_inputs` of a stage that has no artifact for ``cfg``: its config slice, raw
    input files and code version as its fingerprint would take them now (no upstream ids)."""
    raw = spec.raw_hashes(cfg)
    return stage_inputs(
        spec.name,
        {
            "config": spec.config(cfg),
            "raw_inputs": {k: {"path": path, "sha256": raw[f"file:{k}"]} for k, path in spec.raw_inputs(cfg).items()},
            "code_version": code_version(f"tasks.{spec.name}"),
        },
    )


def from_artifact(label: str, store: ArtifactStore, artifact_id: str) -> Run:
    """The artifact, every artifact it was built from, and for each later stage the newest
    artifact built from these (an rl artifact's evaluate and export).

    Raises:
        CompareError: the artifact is not in ``store``.
    """
    stage = artifact_id.rsplit("-", 1)[0]
    manifest = _read_manifest(store, stage, artifact_id)
    if manifest is None:
        raise CompareError(
            f"{label}: no artifact {artifact_id} in {store.root} (give --artifact-root, or the artifact's directory)"
        )
    run = Run(label, "artifact", store)
    todo = [manifest]
    while todo:  # upstream, through each manifest's inputs
        m = todo.pop()
        if m["stage"] in run.manifests:
            continue
        run.add(m)
        for up, ref in m.get("inputs", {}).items():
            if up not in run.manifests and (um := _read_manifest(store, up, ref["artifact_id"])) is not None:
                todo.append(um)
    for later in STAGE_NAMES[STAGE_NAMES.index(stage) + 1 :]:  # downstream: built from what we have
        if later in run.manifests:
            continue
        built_from_ours = [
            m
            for m in store.list(later)
            if m.get("inputs")
            and any(up in run.manifests for up in m["inputs"])
            and all(
                run.manifests[up]["artifact_id"] == ref["artifact_id"]
                for up, ref in m["inputs"].items()
                if up in run.manifests
            )
        ]
        if built_from_ours:
            run.add(built_from_ours[-1])  # store.list is oldest first
            if len(built_from_ours) > 1:
                run.notes.append(f"{later}: the newest of {len(built_from_ours)} artifacts built from these")
    return run


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompareError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def experiment_commit(name: str) -> str | None:
    """The commit of the DVC experiment ``name`` in the repository of the working directory
    (DVC's own name resolution: ``dvc exp list``), or None when there is none of that name."""
    # dvc: heavy to import; only DVC lookups need it
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    from dvc.repo.experiments.utils import resolve_name

    try:
        with Repo(".") as repo:
            info = resolve_name(repo.scm, name).get(name)
            return repo.scm.get_ref(str(info)) if info is not None else None
    except DvcException:  # not a DVC repository, or no git
        return None


def _params_file(commit: str) -> str:
    """The params file the stages of ``dvc.yaml`` read at ``commit`` (dvc.yaml's ``vars``
    interpolated by DVC's own resolver), e.g. ``configs/quickstart.yaml``."""
    # dvc: heavy to import; only DVC lookups need it
    from dvc.parsing import DataResolver
    from dvc.repo import Repo

    raw = yaml.safe_load(_git("show", f"{commit}:dvc.yaml"))
    with Repo(".") as repo:
        stages = DataResolver(repo, repo.root_dir, raw).resolve()["stages"]
    files = {f for st in stages.values() for p in st.get("params", []) if isinstance(p, dict) for f in p}
    if len(files) != 1:
        raise CompareError(
            f"dvc.yaml at {commit[:7]} reads {len(files)} params files ({', '.join(sorted(files))}); "
            "compare needs the one pipeline config"
        )
    return files.pop()


def from_experiment(label: str, commit: str) -> Run:
    """The DVC experiment at ``commit``: its params file is the config, and the pointer
    files it committed (``outputs/<run.name>/<stage>.json``) name its artifacts.

    Raises:
        ConfigError: the committed params file is not a valid config.
    """
    # prefect (via tasks.graph, tasks.runner): 1-2 s to import; only flows and stage runs need it
    from tasks.graph import enabled_stages
    from tasks.runner import store_for

    params = _params_file(commit)
    with tempfile.TemporaryDirectory() as tmp:  # relative paths in it stay relative to the project
        path = Path(tmp) / Path(params).name
        path.write_text(_git("show", f"{commit}:{params}"))
        try:
            cfg = load_config(path)
        except ConfigError as exc:
            raise CompareError(f"experiment {label} ({params} at {commit[:7]}): {exc}") from None
    run = Run(label, "experiment", store_for(cfg))
    for spec, _ in enabled_stages(cfg):
        try:
            pointer = json.loads(_git("show", f"{commit}:outputs/{cfg.run.name}/{spec.name}.json"))
        except (CompareError, json.JSONDecodeError):
            pointer = {}
        manifest = _read_manifest(run.store, spec.name, pointer["artifact_id"]) if "artifact_id" in pointer else None
        if manifest is None:
            run.inputs[spec.name] = _unbuilt_inputs(spec, cfg)
            run.notes.append(f"{spec.name}: the experiment's commit {commit[:7]} names no artifact in {run.store.root}")
        else:
            run.add(manifest)
    return run


def resolve(arg: str, artifact_root: str | None = None, overrides: Sequence[str] = ()) -> Run:
    """One argument of ``posttrain compare`` as a :class:`Run`: a config file (with
    ``overrides`` applied, ``config.load.load_config``), an artifact id (in ``artifact_root``,
    default ``artifacts``) or directory, or a DVC experiment name.

    Raises:
        CompareError: ``arg`` is none of these, or has overrides but is no config file.
        ConfigError: a config file (or an experiment's params file) is invalid.
    """
    # fsspec (via tasks.artifacts): ~0.1 s to import; only artifact stores need it
    from tasks.artifacts import ArtifactStore

    path = Path(arg)
    if path.is_file():
        return from_config(" ".join([arg, *overrides]), load_config(path, overrides))
    if overrides:
        raise CompareError(f"{' '.join(overrides)}: overrides follow a config file; {arg!r} is none")
    if ARTIFACT_ID.fullmatch(path.name) and (path / "manifest.json").is_file():
        return from_artifact(arg, ArtifactStore(str(path.resolve().parents[1])), path.name)
    if ARTIFACT_ID.fullmatch(arg):
        return from_artifact(arg, ArtifactStore(artifact_root or "artifacts"), arg)
    commit = experiment_commit(arg)
    if commit is not None:
        return from_experiment(arg, commit)
    raise CompareError(
        f"{arg!r} is not a config file, an artifact id (<stage>-<16 hex digits>) or directory, "
        "nor a DVC experiment of this repository (dvc exp list --all-commits)"
    )


# --- comparing ------------------------------------------------------------------------------
