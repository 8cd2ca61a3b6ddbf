"""Experiment tracking for one stage run: a W&B run (offline by default) + the Prefect logger.

One W&B run per stage, ``group`` = the pipeline run (so a pipeline's stages sit together),
``job_type`` = the stage name, ``name`` = the artifact id. ``WANDB_MODE`` in the
environment overrides ``wandb.mode`` from the config, as W&B users expect.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from config.schema import PipelineConfig


class StageTracker:
    """Logs step metrics to W&B and, at most every few seconds, to the run logger."""

    def __init__(self, cfg: PipelineConfig, stage: str, artifact_id: str, stage_config: Any, logger: logging.Logger | logging.LoggerAdapter):
        self.logger = logger
        self.group = os.environ.get("POSTTRAIN_PIPELINE_RUN") or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self._last_log = 0.0
        self.run = None
        mode = os.environ.get("WANDB_MODE", cfg.wandb.mode)
        if cfg.wandb.enabled and mode != "disabled":
            import wandb

            os.makedirs(cfg.wandb.dir, exist_ok=True)
            self.run = wandb.init(
                project=cfg.wandb.project,
                group=self.group,
                job_type=stage,
                name=artifact_id,
                config={"stage": stage, "pipeline": cfg.run.name, stage: stage_config},
                mode=mode,
                dir=cfg.wandb.dir,
                reinit="create_new",
                settings=wandb.Settings(console="off", silent=True),
            )

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)
        now = time.time()
        if now - self._last_log > 5.0:
            self._last_log = now
            shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))
            self.logger.info("step %d: %s", step, shown)

    def finish(self, summary: dict[str, Any], ok: bool) -> None:
        if self.run is None:
            return
        for k, v in summary.items():
            if isinstance(v, (int, float, str)):
                self.run.summary[k] = v
        self.run.finish(exit_code=0 if ok else 1)
        self.run = None
