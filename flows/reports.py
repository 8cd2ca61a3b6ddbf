"""What a pipeline run shows in Prefect, and the summary the CLI prints.

Per stage, cached or run: a table artifact ``<run>-<stage>`` with the Prefect state
(Completed or Cached), the artifact id and URI, the fingerprint, the W&B run and the
stage's metrics (headline figures first). Per pipeline run: ``<run>-config``, the config
actually used as YAML with its diff against the previous run's (Prefect keeps every version
of a key, so the previous one is the key's latest before this run), and ``<run>-summary``,
the table and accuracy lines ``posttrain run`` prints, with each stage's W&B run (a link when
the run is online, the offline directory otherwise). Artifact keys hold only lowercase
letters, digits and dashes (Prefect's rule), so ``run.name`` is slugged.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

import yaml

from config.schema import PipelineConfig

_YAML_BLOCK = re.compile(r"```yaml\n(.*?)```", re.S)


def artifact_key(cfg: PipelineConfig, what: str) -> str:
    """The Prefect artifact key ``<run.name>-<what>`` with everything outside ``[a-z0-9-]`` as ``-``."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", f"{cfg.run.name}-{what}".lower())).strip("-")


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.6g}"


def stage_rows(name: str, entry: dict[str, Any], headline: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """The rows of a stage's table artifact: ``{"field", "value"}`` for the state, wall time
    (s), artifact id, URI, fingerprint, W&B run, then every metric (``headline`` keys first).

    Args:
        name: the stage.
        entry: the stage's entry of the pipeline summary (``state``, ``wall_s``,
            ``artifact_id``, ``uri``, ``fingerprint``, ``metrics``, optional ``wandb``).
        headline: the stage's summary metric keys (``StageSpec.summary``).
    """
    rows = [{"field": "stage", "value": name}, {"field": "state", "value": str(entry.get("state", "-"))}]
    for key in ("wall_s", "artifact_id", "uri", "fingerprint"):
        if key in entry:
            rows.append({"field": key, "value": _number(entry[key])})
    wandb = entry.get("wandb") or {}
    if wandb:
        rows.append({"field": "wandb run", "value": wandb_text(wandb)})
    metrics = entry.get("metrics") or {}
    for key in [k for k in headline if k in metrics] + sorted(k for k in metrics if k not in headline):
        rows.append({"field": f"metric: {key}", "value": _number(metrics[key])})
    return rows


def wandb_text(run: dict[str, Any]) -> str:
    """One W&B run (``tasks.tracking.run_info``) as text: its URL when online, else
    ``<run id> (<mode>: <local dir>)``."""
    if run.get("url"):
        return str(run["url"])
    where = f" ({run.get('mode', 'offline')}: {run['dir']})" if run.get("dir") else ""
    return f"{run.get('run_id', '?')}{where}"


def config_yaml(cfg: PipelineConfig) -> str:
    """The resolved config (defaults filled in) as YAML, keys in schema order."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_markdown(config_path: str, now: str, previous: str | None) -> str:
    """Markdown of the config used: the diff against ``previous`` (the last run's YAML;
    None: no earlier run) as a unified diff, then the full YAML ``now``."""
    if previous is None:
        change = "No earlier run of this pipeline name reported its config."
    elif previous == now:
        change = "Unchanged since the previous run."
    else:
        diff = difflib.unified_diff(
            previous.splitlines(), now.splitlines(), "previous run", "this run", lineterm="", n=1
        )
        change = "Changed since the previous run:\n\n```diff\n" + "\n".join(diff) + "\n```"
    return f"# Config used: `{config_path}`\n\n{change}\n\n```yaml\n{now}```\n"


def previous_config(markdown: str | None) -> str | None:
    """The YAML a :func:`config_markdown` report holds (None when there is none)."""
    found = _YAML_BLOCK.search(markdown or "")
    return found.group(1) if found else None


def format_metric(metrics: dict[str, Any], key: str) -> str:
    """``value ± SE`` when ``<key>_se`` is there, else the value; ``-`` when missing."""
    if key not in metrics:
        return "-"
    se = metrics.get(f"{key}_se")
    return f"{metrics[key]:.3f} ± {se:.3f}" if isinstance(se, (int, float)) else f"{metrics[key]:.4g}"


def result_lines(summary: dict[str, Any]) -> list[str]:
    """The lines under the summary table: base/SFT and RL accuracy with SE, their paired
    difference, the exported model's path, the total wall time (s)."""
    lines = []
    ev = summary["stages"].get("evaluate", {}).get("metrics", {})
    if ev:
        base = next((b for b in ("po", "sft") if f"{b}/accuracy" in ev), "base")
        label = {"po": "PO", "sft": "SFT", "base": "base"}[base]
        lines.append(
            f"{label + ' accuracy:':<15}{format_metric(ev, f'{base}/accuracy')}   (n={ev.get(f'{base}/n', '?')})"
        )
        lines.append(f"{'RL accuracy:':<15}{format_metric(ev, 'rl/accuracy')}   (n={ev.get('rl/n', '?')})")
        if f"rl_minus_{base}/accuracy" in ev:
            delta, se = ev[f"rl_minus_{base}/accuracy"], ev[f"rl_minus_{base}/accuracy_se"]
            ratio = f"{delta / se:+.1f} SE" if se > 0 else "SE 0"
            lines.append(f"{'RL − ' + label + ':':<15}{delta:+.3f} ± {se:.3f}   (paired over prompts; {ratio})")
    ex = summary["stages"].get("export")
    if ex and ex.get("uri"):
        # A URI, not a Path: Path("s3://b/x") would print s3:/b/x.
        lines.append(f"Exported model (HF SafeTensors): {ex['uri'].rstrip('/')}/hf_model")
    lines.append(f"Total wall time: {sum(s['wall_s'] for s in summary['stages'].values()):.1f} s")
    return lines


def summary_markdown(summary: dict[str, Any]) -> str:
    """The run summary as markdown: one row per stage (state, wall time, artifact, W&B run),
    then :func:`result_lines`."""
    lines = [
        "# posttrain: pipeline summary",
        "",
        "| stage | state | wall time (s) | artifact | W&B run |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary["stages"].items():
        run = wandb_text(s["wandb"]) if s.get("wandb") else "-"
        lines.append(f"| {name} | {s.get('state', '-')} | {s['wall_s']:.1f} | {s.get('artifact_id', '-')} | {run} |")
    lines += ["", *(f"    {line}" for line in result_lines(summary))]
    if summary.get("wandb_group"):
        lines += ["", f"W&B group: `{summary['wandb_group']}`"]
    return "\n".join(lines) + "\n"


def publish_stage(cfg: PipelineConfig, name: str, entry: dict[str, Any], headline: tuple[str, ...] = ()) -> None:
    """Create the stage's table artifact (key ``<run>-<stage>``) in the current flow run.

    Raises:
        prefect.exceptions.PrefectHTTPStatusError: the Prefect API refused it.
    """
    # prefect: 1-2 s to import; only flows and stage runs need it
    from prefect.artifacts import create_table_artifact

    create_table_artifact(
        stage_rows(name, entry, headline),
        key=artifact_key(cfg, name),
        description=f"{name} of {cfg.run.name}: {entry.get('state', '-')}, {entry.get('artifact_id', '-')}",
    )


def publish_config(cfg: PipelineConfig, config_path: str) -> str:
    """Create ``<run>-config`` (the config used and its diff against the previous version of
    that artifact); returns the markdown."""
    # prefect: 1-2 s to import; only flows and stage runs need it
    from prefect.artifacts import Artifact, create_markdown_artifact

    key = artifact_key(cfg, "config")
    last = Artifact.get(key)  # called from sync code: the stored artifact or None (prefect types the async result too)
    data = getattr(last, "data", None)
    markdown = config_markdown(config_path, config_yaml(cfg), previous_config(data if isinstance(data, str) else None))
    create_markdown_artifact(markdown, key=key, description=f"config of {cfg.run.name} ({config_path})")
    return markdown


def publish_summary(cfg: PipelineConfig, summary: dict[str, Any]) -> None:
    """Create ``<run>-summary`` (:func:`summary_markdown`) and a link artifact per online W&B run."""
    # prefect: 1-2 s to import; only flows and stage runs need it
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    create_markdown_artifact(
        summary_markdown(summary), key=artifact_key(cfg, "summary"), description=f"summary of {cfg.run.name}"
    )
    for name, s in summary["stages"].items():
        url = (s.get("wandb") or {}).get("url")
        if url:
            create_link_artifact(url, link_text=f"W&B: {name}", key=artifact_key(cfg, f"{name}-wandb"))
