"""What ``posttrain chat``, ``serve`` and ``push`` take as their model: ``<artifact|config>``.

A model reference is one of

- an artifact directory of a stage that holds a policy (``export``: ``hf_model/``; ``rl``,
  ``po``, ``sft``, ``convert``: ``model/``, a Megatron checkpoint plus ``hf/``), recognised by
  its ``manifest.json``; a plain HF directory (``config.json`` + SafeTensors) is taken as it is;
- an artifact id (``rl-0123456789abcdef``), looked up under ``--artifact-root``;
- a pipeline config YAML (with ``KEY=VALUE`` overrides, as ``run`` and ``status`` take them):
  the newest stage of the policy chain (export > rl > po > sft) that has a current artifact
  for the config (as ``posttrain status`` decides), or the one ``--stage NAME`` names.

:func:`find_model_artifact` finds the artifact; :func:`hf_model_dir` gives a directory that
transformers and vLLM load: the export's ``hf_model/`` as it is, a Megatron checkpoint converted
once (as the evaluate stage converts it, :func:`engine.storage.hf_io.export_model_dir`, float32)
into a cache directory keyed by the artifact's id and content hash. Every bad reference is a
:class:`config.ConfigError` whose one line names the argument and the fix.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from config import ConfigError, load_config
from config.stages import policy_chain

# Stages whose artifact holds a policy (config.stages.policy_chain), newest first; the last is
# convert: the base model as converted.
MODEL_STAGES = tuple(reversed(policy_chain()))
# What a config resolves to when no --stage is given: the trained ones, newest first.
POLICY_CHAIN = MODEL_STAGES[:-1]
ARTIFACT_ID = re.compile(r"^([a-z]+)-[0-9a-f]{16}$")
DEFAULT_ARTIFACT_ROOT = "artifacts"  # the quickstart's run.artifact_root
HF_CACHE = Path(tempfile.gettempdir()) / "posttrain-hf-models"


@dataclass(frozen=True)
class ModelArtifact:
    """A policy found from a model reference.

    Attributes:
        name: the artifact id (what chat shows and serve names the model); a plain HF
            directory's own name.
        stage: the artifact's stage (``"hf"`` for a plain HF directory).
        path: the local artifact directory (downloaded once for a remote store).
        content_hash: the manifest's content hash ("" for a plain HF directory).
    """

    name: str
    stage: str
    path: Path
    content_hash: str = ""

    @property
    def is_hf(self) -> bool:
        """Whether :attr:`path` holds HF weights as they are (an export or a plain HF directory)."""
        return self.stage in ("export", "hf")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model reference arguments of chat, serve and push: ``model``, ``KEY=VALUE``
    overrides, ``--stage`` and ``--artifact-root``."""
    p.add_argument(
        "model", help="an artifact directory, an artifact id (e.g. rl-0123456789abcdef) or a pipeline config (YAML)"
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, as `posttrain run` takes them")
    p.add_argument(
        "--stage",
        choices=MODEL_STAGES,
        default=None,
        help=f"with a config: the stage whose model to use (default: the newest current of {' > '.join(POLICY_CHAIN)})",
    )
    p.add_argument(
        "--artifact-root",
        default=DEFAULT_ARTIFACT_ROOT,
        help=f"where an artifact id is looked up (default: {DEFAULT_ARTIFACT_ROOT}, the quickstart's run.artifact_root)",
    )


def find_model_artifact(
    target: str,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    stage: str | None = None,
    artifact_root: str = DEFAULT_ARTIFACT_ROOT,
) -> ModelArtifact:
    """The policy artifact ``target`` names (see the module docstring for the forms).

    Args:
        target: an artifact directory, a plain HF directory, an artifact id or a config YAML.
        overrides: ``KEY=VALUE`` config overrides (a config only).
        stage: with a config, the stage to take (one of :data:`MODEL_STAGES`); with an
            artifact, the artifact's stage must be this one.
        artifact_root: the store an artifact id is looked up in (a path or fsspec URL).

    Raises:
        ConfigError: ``target`` is none of the forms; the artifact is of a stage without a
            policy (validate, rm, evaluate); the id is not published under ``artifact_root``;
            the config is invalid, or no stage of its chain (or ``stage``) has a current
            artifact (the message says which command to run).
    """
    path = Path(target)
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        return _from_config(target, list(overrides), stage)
    if overrides:
        raise ConfigError(f"{target}: KEY=VALUE overrides ({' '.join(overrides)}) apply to a config only")
    if path.is_dir():
        found = _from_directory(path)
    elif ARTIFACT_ID.match(target):
        found = _from_id(target, artifact_root)
    else:
        raise ConfigError(
            f"{target}: no such artifact directory, config file or artifact id "
            "(give an artifact directory, an id like rl-0123456789abcdef, or a pipeline config .yaml)"
        )
    if stage is not None and found.stage != stage:
        raise ConfigError(
            f"{target} is an artifact of stage {found.stage}; this needs one of stage {stage} (check --stage)"
        )
    return found


def hf_model_dir(artifact: ModelArtifact, cache_dir: str | Path | None = None) -> Path:
    """An HF directory (config.json, model.safetensors, tokenizer, generation config) of ``artifact``.

    An export (or plain HF directory) is used in place. A Megatron checkpoint (``model/``) is
    converted as the evaluate stage converts it, in float32 (the checkpoint's own precision),
    into ``cache_dir/<artifact id>-<content hash[:12]>`` (default under the temporary
    directory), once: a later call finds it there. The conversion writes atomically.

    Raises:
        ConfigError: the artifact has no ``model/`` or ``hf_model/`` directory.
        Errors of :func:`engine.storage.hf_io.export_model_dir` for a corrupt checkpoint.
    """
    if artifact.stage == "hf":
        return artifact.path
    if artifact.stage == "export":
        out = artifact.path / "hf_model"
        if not (out / "config.json").is_file():
            raise ConfigError(f"{artifact.path}: export artifact without hf_model/config.json")
        return out
    model_dir = artifact.path / "model"
    if not (model_dir / "hf" / "config.json").is_file():
        raise ConfigError(f"{artifact.path}: {artifact.stage} artifact without model/hf/config.json")
    out = Path(cache_dir or HF_CACHE) / f"{artifact.name}-{artifact.content_hash[:12]}"
    if (out / "config.json").is_file():
        return out
    # torch (via engine.storage.hf_io): seconds to import, not paid until this runs
    from engine.storage.hf_io import export_model_dir

    out.parent.mkdir(parents=True, exist_ok=True)
    return export_model_dir(model_dir, out, dtype="float32")


def _from_directory(path: Path) -> ModelArtifact:
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return ModelArtifact(path.resolve().name, "hf", path.resolve())
        raise ConfigError(
            f"{path}: neither an artifact directory (no manifest.json) nor an HF model directory "
            "(config.json + *.safetensors)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        stage, artifact_id = manifest["stage"], manifest["artifact_id"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{manifest_path}: not a readable artifact manifest ({type(exc).__name__}: {exc})") from None
    _check_model_stage(stage, str(path))
    return ModelArtifact(artifact_id, stage, path.resolve(), str(manifest.get("content_hash", "")))


def _from_id(artifact_id: str, artifact_root: str) -> ModelArtifact:
    # fsspec (via tasks.artifacts): ~0.1 s to import; only artifact stores need it
    from tasks.artifacts import ArtifactRef, ArtifactStore

    matched = ARTIFACT_ID.match(artifact_id)
    assert matched is not None  # the caller matched it
    stage = matched.group(1)
    _check_model_stage(stage, artifact_id)
    store = ArtifactStore(artifact_root)
    manifest = next((m for m in store.list(stage) if m.get("artifact_id") == artifact_id), None)
    if manifest is None:
        raise ConfigError(
            f"artifact {artifact_id} is not published under {artifact_root}; give --artifact-root "
            "(the config's run.artifact_root) or the artifact's directory"
        )
    ref = ArtifactRef(
        stage=stage,
        artifact_id=artifact_id,
        fingerprint=manifest["fingerprint"],
        uri=f"{store.root}/{stage}/{artifact_id}",
        content_hash=manifest.get("content_hash", ""),
    )
    return ModelArtifact(artifact_id, stage, store.local_path(ref), ref.content_hash)


def _check_model_stage(stage: str, what: str) -> None:
    if stage not in MODEL_STAGES:
        raise ConfigError(
            f"{what} is an artifact of stage {stage}, which holds no policy model; give one of "
            f"{', '.join(MODEL_STAGES)}"
        )


def _from_config(config: str, overrides: list[str], stage: str | None) -> ModelArtifact:
    # prefect (via tasks.graph, tasks.runner): 1-2 s to import; only flows and stage runs need it
    from tasks.graph import stage_states
    from tasks.runner import store_for

    cfg = load_config(config, overrides)
    command = shlex.join([config, *overrides])
    store = store_for(cfg)
    states = stage_states(cfg, store)
    if stage is not None and stage not in states:
        raise ConfigError(f"{config}: stage {stage} is switched off in this config ({stage}.enabled is false)")
    for name in (stage,) if stage else POLICY_CHAIN:
        state = states.get(name)
        if state is not None and state.ref is not None:
            return ModelArtifact(state.ref.artifact_id, name, store.local_path(state.ref), state.ref.content_hash)
    if stage:
        raise ConfigError(
            f"{config}: stage {stage} has no current artifact for this config; run "
            f"`posttrain run {command}` (or `posttrain stage {stage} {command}`) first"
        )
    raise ConfigError(
        f"{config}: no stage of {', '.join(POLICY_CHAIN)} has a current artifact for this config; run "
        f"`posttrain run {command}` first (`posttrain status {command}` shows each stage)"
    )
