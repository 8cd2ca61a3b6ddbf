"""The top-level pipeline config, composing one section per stage.

The sections live in one module per stage (``config.prepare``, ``config.data``,
``config.convert``, ``config.sft``, ``config.rm``, ``config.po``, ``config.rl``, ``config.evaluate``,
``config.export``), beside the shared ones (``config.run``: run and W&B tracking;
``config.training``: optimizer and DeepSpeed) and their base (``config.base.Strict``).
Every model is frozen and forbids unknown keys, so a typo is an error naming the key
instead of a silently ignored setting. Booleans are named ``<noun>_enabled`` or
``<verb>_<noun>`` throughout; paths are plain strings, and relative paths are taken
relative to the current working directory (where ``posttrain`` and ``dvc repro`` run),
not to the config file.
"""

from __future__ import annotations

from pydantic import PrivateAttr, model_validator

from config.base import Strict
from config.convert import ConvertConfig, ModelConfig
from config.data import DataConfig
from config.evaluate import EvaluateConfig
from config.export import ExportConfig
from config.po import PoConfig
from config.precision import DTYPE_NAMES, resolve_precision
from config.prepare import PrepareConfig
from config.rl import RLConfig
from config.rm import RMConfig
from config.run import RunConfig, WandbConfig
from config.sft import SFTConfig
from config.stages import precision_stages

PRECISION_STAGES = precision_stages()  # the sections with a `precision` setting (config.stages)


class PipelineConfig(Strict):
    """The whole pipeline. Stage sections map 1:1 to stages; ``run``/``wandb`` are shared."""

    run: RunConfig
    wandb: WandbConfig = WandbConfig()
    prepare: PrepareConfig | None = None
    data: DataConfig
    model: ModelConfig
    convert: ConvertConfig = ConvertConfig()
    sft: SFTConfig = SFTConfig()
    rm: RMConfig = RMConfig()
    po: PoConfig = PoConfig()
    rl: RLConfig = RLConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    export: ExportConfig = ExportConfig()

    # Not a setting: the command-line overrides the config was loaded with (config.load), kept
    # out of model_dump and so out of every fingerprint; the manifests record them.
    _overrides: tuple[str, ...] = PrivateAttr(default=())

    @property
    def overrides(self) -> tuple[str, ...]:
        """The ``KEY=VALUE`` overrides applied on top of the YAML file (``posttrain run CONFIG
        KEY=VALUE ...``), in the order given; empty for a config read from its file alone."""
        return self._overrides

    @model_validator(mode="after")
    def _resolve_precision(self):
        # Every stage that trains or generates gets a concrete precision (its own setting, else
        # run.precision; auto decided by the hardware, config.precision), and the export its dtype,
        # so what a stage ran in is in its fingerprint and manifest.
        for stage in PRECISION_STAGES:
            section = getattr(self, stage)
            resolved = resolve_precision(section.precision or self.run.precision)
            if section.precision != resolved:
                object.__setattr__(self, stage, section.model_copy(update={"precision": resolved}))
        if self.export.dtype is None:
            rl_precision = self.rl.precision
            assert rl_precision is not None  # resolved in the loop above
            object.__setattr__(self, "export", self.export.model_copy(update={"dtype": DTYPE_NAMES[rl_precision]}))
        return self

    @model_validator(mode="after")
    def _po_data(self):
        if self.po.enabled and self.data.preference is None and self.data.kto is None:
            raise ValueError(
                "po.enabled needs preference pairs: set data.preference (or, for po.loss: kto, the "
                "unpaired rows of data.kto; or po.enabled: false)"
            )
        if self.po.enabled and self.data.kto is not None and self.po.loss != "kto":
            raise ValueError(
                f"data.kto: unpaired desirable/undesirable rows train only po.loss: kto, not "
                f"{self.po.loss!r}; set po.loss: kto, or give pairs in data.preference and unset data.kto"
            )
        return self

    @model_validator(mode="after")
    def _eval_benchmark(self):
        # rl.eval_every evaluates one of the evaluate stage's benchmarks, with its settings
        if self.rl.eval_every:
            names = [b.name for b in self.evaluate.benchmarks(self.rl.reward.verifier, self.data.rl_eval is not None)]
            if self.rl.eval_benchmark not in names:
                known = ", ".join(names) or "none: set data.rl_eval or evaluate.datasets"
                raise ValueError(
                    f"rl.eval_benchmark: {self.rl.eval_benchmark!r} is not a benchmark of the evaluate stage ({known})"
                )
        return self
