"""What a stage is, for the pipeline: :class:`StageSpec` (its name, upstream stages, the
config and raw input files it depends on, and how they make its fingerprint).

Its own module so that the stage graph (``tasks.graph``), the runner (``tasks.runner``) and
the tools that compare configs (``flows.compare``) share it without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from config.schema import PipelineConfig
from tasks.fingerprint import code_version, fingerprint, hash_path


@dataclass(frozen=True)
class StageSpec:
    """A pipeline stage: its name, upstream stages and the config it depends on.

    inputs: upstream stage names (given the config: e.g. rl needs rm only when the
        reward model is used).
    config: the slice of the pipeline config that changes this stage's output.
    raw_inputs: files or directories outside the artifact store read by the stage
        (hashed into the fingerprint by content).
    summary: metric keys shown by ``posttrain status`` and the run summary.
    """

    name: str
    inputs: Callable[[PipelineConfig], tuple[str, ...]]
    config: Callable[[PipelineConfig], Any]
    raw_inputs: Callable[[PipelineConfig], dict[str, str]] = lambda cfg: {}
    summary: tuple[str, ...] = ()

    def raw_hashes(self, cfg: PipelineConfig) -> dict[str, str]:
        """``file:<key>`` -> content hash of each raw input, as they are on disk now."""
        return {f"file:{k}": hash_path(v) for k, v in self.raw_inputs(cfg).items()}

    def fingerprint(self, cfg: PipelineConfig, input_hashes: dict[str, str], raw: dict[str, str] | None = None) -> str:
        """The stage's fingerprint given ``input_hashes`` (upstream stage -> the content hash
        of its artifact, ``ArtifactRef.content_hash``) and ``raw`` (:meth:`raw_hashes`,
        computed now when not given)."""
        raw = self.raw_hashes(cfg) if raw is None else raw
        # A raw input enters by its content: where it lies (its path's spelling, the working
        # directory, a copy of the project elsewhere) does not change the result.
        by_content = {path: f"<content of {key}>" for key, path in self.raw_inputs(cfg).items()}
        config = _replace_strings(self.config(cfg), by_content)
        return fingerprint(self.name, {**input_hashes, **raw}, config, code_version(f"tasks.{self.name}"))


def _replace_strings(value: Any, table: dict[str, str]) -> Any:
    """``value`` with every string that is a key of ``table`` replaced (through dicts and lists)."""
    if isinstance(value, dict):
        return {k: _replace_strings(v, table) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_replace_strings(v, table) for v in value]
    return table.get(value, value) if isinstance(value, str) else value
