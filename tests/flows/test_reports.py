"""What a run shows in Prefect (flows/reports.py): the stage tables, the config with its diff
against the previous run and the summary, created in a real flow run on Prefect's temporary
server and read back through its API; and the CLI's summary lines from the same code."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from config import load_config
from flows import reports
from flows.prefect_server import prefect_api

REPO = Path(__file__).resolve().parents[2]
SUMMARY = {
    "stages": {
        "rl": {
            "state": "Completed",
            "wall_s": 61.25,
            "artifact_id": "rl-0123456789ab",
            "uri": "/a/rl/rl-0123456789ab",
            "fingerprint": "f" * 64,
            "metrics": {"actor/pg_loss": -0.5, "critic/score/mean": 0.75, "timing_s/stage": 61.0},
            "wandb": {
                "run_id": "rl-abc",
                "mode": "offline",
                "url": None,
                "dir": "wandb/wandb/offline-run-20261201_120000-rl-abc",
            },
        },
        "evaluate": {
            "state": "Cached",
            "wall_s": 0.25,
            "artifact_id": "evaluate-0a",
            "uri": "/a/evaluate/evaluate-0a",
            "fingerprint": "e" * 64,
            "metrics": {
                "sft/accuracy": 0.25,
                "sft/accuracy_se": 0.05,
                "sft/n": 24,
                "rl/accuracy": 0.5,
                "rl/accuracy_se": 0.1,
                "rl/n": 24,
                "rl_minus_sft/accuracy": 0.25,
                "rl_minus_sft/accuracy_se": 0.125,
            },
            "wandb": {
                "run_id": "ev-1",
                "mode": "online",
                "url": "https://wandb.ai/me/posttrain/runs/ev-1",
                "dir": "wandb/wandb/run-1-ev-1",
            },
        },
        "export": {
            "state": "Cached",
            "wall_s": 0.5,
            "artifact_id": "export-0b",
            "uri": "s3://bucket/export/export-0b/",
        },
    }
}


def test_artifact_keys_are_what_prefect_accepts():
    cfg = load_config(REPO / "configs" / "quickstart.yaml")
    assert reports.artifact_key(cfg, "rl") == "quickstart-rl"
    renamed = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": "My_Run.v2"})})
    assert reports.artifact_key(renamed, "config") == "my-run-v2-config"


def test_stage_rows_put_state_ids_and_headline_metrics_first():
    rows = reports.stage_rows("rl", SUMMARY["stages"]["rl"], headline=("critic/score/mean", "actor/pg_loss"))
    assert rows == [
        {"field": "stage", "value": "rl"},
        {"field": "state", "value": "Completed"},
        {"field": "wall_s", "value": "61.25"},
        {"field": "artifact_id", "value": "rl-0123456789ab"},
        {"field": "uri", "value": "/a/rl/rl-0123456789ab"},
        {"field": "fingerprint", "value": "f" * 64},
        {"field": "wandb run", "value": "rl-abc (offline: wandb/wandb/offline-run-20261201_120000-rl-abc)"},
        {"field": "metric: critic/score/mean", "value": "0.75"},
        {"field": "metric: actor/pg_loss", "value": "-0.5"},
        {"field": "metric: timing_s/stage", "value": "61"},
    ]


def test_result_lines_are_the_cli_summary():
    lines = reports.result_lines(SUMMARY)
    assert lines == [
        "SFT accuracy:  0.250 ± 0.050   (n=24)",
        "RL accuracy:   0.500 ± 0.100   (n=24)",
        "RL − SFT:      +0.250 ± 0.125   (paired over prompts; +2.0 SE)",
        "Exported model (HF SafeTensors): s3://bucket/export/export-0b/hf_model",
        "Total wall time: 62.0 s",
    ]
    markdown = reports.summary_markdown(SUMMARY)
    assert (
        "| rl | Completed | 61.2 | rl-0123456789ab | rl-abc (offline: wandb/wandb/offline-run-20261201_120000-rl-abc) |"
        in markdown
    )
    assert "| evaluate | Cached | 0.2 | evaluate-0a | https://wandb.ai/me/posttrain/runs/ev-1 |" in markdown
    assert "| export | Cached | 0.5 | export-0b | - |" in markdown
    assert all(f"    {line}" in markdown for line in lines)
    assert "W&B group" not in markdown
    assert "W&B group: `quickstart-0123456789ab`" in reports.summary_markdown(
        {**SUMMARY, "wandb_group": "quickstart-0123456789ab"}
    )


def test_config_markdown_diffs_against_the_previous_run():
    cfg = load_config(REPO / "configs" / "quickstart.yaml")
    first = reports.config_markdown("configs/quickstart.yaml", reports.config_yaml(cfg), None)
    assert "No earlier run" in first
    assert reports.previous_config(first) == reports.config_yaml(cfg)
    changed = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"steps": cfg.rl.steps + 7})})
    second = reports.config_markdown(
        "configs/quickstart.yaml", reports.config_yaml(changed), reports.previous_config(first)
    )
    diff = second.split("```diff\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")] == [
        f"-  steps: {cfg.rl.steps}",
        f"+  steps: {cfg.rl.steps + 7}",
    ]
    assert "Unchanged since the previous run." in reports.config_markdown(
        "c.yaml", reports.config_yaml(cfg), reports.config_yaml(cfg)
    )


@flow
def _report_run(config_path: str, rl_steps: int) -> str:
    from prefect.runtime import flow_run

    cfg = load_config(config_path)
    cfg = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"steps": rl_steps})})
    reports.publish_config(cfg, config_path)
    reports.publish_stage(cfg, "rl", SUMMARY["stages"]["rl"], ("critic/score/mean",))
    reports.publish_summary(cfg, SUMMARY)
    return str(flow_run.get_id())


def test_artifacts_reach_the_prefect_api():
    config = str(REPO / "configs" / "quickstart.yaml")
    with prefect_api():
        # The temporary server keeps its database in PREFECT_HOME: earlier runs' artifacts
        # may be there too, so the first run's config diff is against whatever came before.
        runs = [_report_run(config, 5), _report_run(config, 9)]
        with get_client(sync_client=True) as client:

            def latest(key):
                found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
                return sorted((a for a in found if str(a.flow_run_id) in runs), key=lambda a: a.created)

            configs = latest("quickstart-config")
            assert [str(a.flow_run_id) for a in configs] == runs
            assert "-  steps: 5\n+  steps: 9" in configs[1].data
            table = latest("quickstart-rl")[-1]
            assert table.type == "table"
            rows = json.loads(table.data) if isinstance(table.data, str) else table.data
            assert {"field": "state", "value": "Completed"} in rows
            assert {"field": "metric: critic/score/mean", "value": "0.75"} in rows
            summary = latest("quickstart-summary")[-1]
            assert summary.type == "markdown" and "| evaluate | Cached |" in summary.data
            link = latest("quickstart-evaluate-wandb")[-1]
            assert (
                link.data == "[W&B: evaluate](https://wandb.ai/me/posttrain/runs/ev-1)"
            )  # Prefect stores links as markdown
