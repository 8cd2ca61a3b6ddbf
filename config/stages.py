"""The pipeline's stages: the one place their names, run order, upstream stages, on/off
switches, policy chain and precision settings are declared.

Every list of stages in the project derives from :data:`STAGES`: the Prefect graph
(``tasks.graph`` pairs each entry with ``tasks/<name>.py``'s ``SPEC`` and its task of the same
name), the CLI's stage names and ``validate`` listing, ``posttrain status`` and ``compare``,
the precision a config resolves (``config.schema``), preflight checks, W&B run config
(``tasks.tracking``) and which artifact holds a model (``flows.model_ref``). ``dvc.yaml`` has
one DVC stage per entry, in this order, whose pointer deps are :attr:`Stage.inputs`
(``tests/flows/test_dvc.py`` checks it).

``prepare`` is not a stage here: it is optional (run only with a ``prepare`` section),
publishes no artifact and feeds the root stages (validate, convert) through files.

This module imports nothing of the project, so the lightest command (``posttrain validate``)
can read it without the training stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    name: the stage's name (``tasks/<name>.py``, ``posttrain stage <name>``, its artifacts'
        ``<name>-<16 hex>`` ids and its DVC stage).
    inputs: every upstream stage whose artifact it can read, under any setting of the
        switches (``StageSpec.inputs`` picks those a config reads: e.g. rm starts from sft, or
        from convert when sft is off); each is earlier in :data:`STAGES`.
    switch: the config section whose ``enabled`` turns the stage off, or None (always runs).
    policy: the stage publishes a policy model (``model/``): the policy chain is these
        stages in run order (:func:`policy_chain`), each starting from the newest enabled one
        before it (:func:`policy_before`).
    precision: its config section has a ``precision`` setting (resolved when the config is
        loaded, ``config.schema``).
    sections: the YAML sections that make the stage's result (the config a W&B run of the
        stage reports, ``tasks.tracking``).
    chat_trainer: trains on chat-rendered text in one torch.distributed group: its section has
        ``max_seq_len`` and ``parallel`` (a ``config.parallel.ParallelConfig``) and the stage
        needs the tokenizer's chat template.
    """

    name: str
    inputs: tuple[str, ...] = ()
    switch: str | None = None
    policy: bool = False
    precision: bool = False
    sections: tuple[str, ...] = ()
    chat_trainer: bool = False

    def enabled(self, cfg: Any) -> bool:
        """Whether ``cfg`` (a ``config.schema.PipelineConfig``) runs this stage:
        ``<switch>.enabled``, or True for a stage without a switch."""
        return self.switch is None or bool(getattr(cfg, self.switch).enabled)


# In run order (a topological order of ``inputs``).
STAGES: tuple[Stage, ...] = (
    Stage("validate", sections=("data",)),
    Stage("convert", policy=True, sections=("model", "convert")),
    Stage(
        "sft",
        inputs=("validate", "convert"),
        switch="sft",
        policy=True,
        precision=True,
        sections=("sft",),
        chat_trainer=True,
    ),
    Stage(
        "rm", inputs=("validate", "convert", "sft"), switch="rm", precision=True, sections=("rm",), chat_trainer=True
    ),
    Stage(
        "po",
        inputs=("validate", "convert", "sft"),
        switch="po",
        policy=True,
        precision=True,
        sections=("po",),
        chat_trainer=True,
    ),
    Stage("rl", inputs=("validate", "convert", "sft", "rm", "po"), policy=True, precision=True, sections=("rl",)),
    Stage("evaluate", inputs=("validate", "convert", "sft", "po", "rl"), precision=True, sections=("evaluate",)),
    Stage("export", inputs=("rl", "evaluate"), policy=True, sections=("export",)),
)


def _check(stages: tuple[Stage, ...]) -> None:
    """Raise ValueError unless names are unique and each stage's inputs are earlier stages."""
    seen: list[str] = []
    for s in stages:
        if s.name in seen:
            raise ValueError(f"config/stages.py: stage {s.name!r} is declared twice")
        late = [u for u in s.inputs if u not in seen]
        if late:
            raise ValueError(
                f"config/stages.py: stage {s.name!r} has inputs {late} that are not earlier stages; "
                "list stages in run order"
            )
        seen.append(s.name)


_check(STAGES)
_BY_NAME = {s.name: s for s in STAGES}


def stage_names() -> tuple[str, ...]:
    """Every stage's name, in run order."""
    return tuple(s.name for s in STAGES)


def get(name: str) -> Stage:
    """The stage called ``name``. Raises KeyError naming the stages for an unknown name."""
    if name not in _BY_NAME:
        raise KeyError(f"unknown stage {name!r}; stages are: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def is_enabled(cfg: Any, name: str) -> bool:
    """:meth:`Stage.enabled` of stage ``name``; True for a name that is not a stage here
    (``prepare``, which runs whenever it is asked for)."""
    return name not in _BY_NAME or _BY_NAME[name].enabled(cfg)


def enabled(cfg: Any) -> tuple[Stage, ...]:
    """The stages ``cfg`` runs, in run order."""
    return tuple(s for s in STAGES if s.enabled(cfg))


def switchable() -> tuple[str, ...]:
    """The stages a config can switch off (``<switch>.enabled``), in run order."""
    return tuple(s.name for s in STAGES if s.switch is not None)


def policy_chain() -> tuple[str, ...]:
    """The stages that publish a policy model, in run order (the base model as converted first)."""
    return tuple(s.name for s in STAGES if s.policy)


def policy_before(cfg: Any, name: str) -> str:
    """The policy ``name`` starts from: the newest stage of :func:`policy_chain` that runs
    before ``name`` and that ``cfg`` enables (e.g. rl: po if on, else sft if on, else
    convert). Raises KeyError for an unknown stage, ValueError when none comes before it."""
    before = stage_names()[: stage_names().index(get(name).name)]
    chain = [s for s in policy_chain() if s in before and _BY_NAME[s].enabled(cfg)]
    if not chain:
        raise ValueError(f"stage {name!r} has no enabled policy stage before it")
    return chain[-1]


def precision_stages() -> tuple[str, ...]:
    """The stages whose config section has a ``precision`` setting, in run order."""
    return tuple(s.name for s in STAGES if s.precision)


def chat_trainers() -> tuple[str, ...]:
    """The stages of :attr:`Stage.chat_trainer`, in run order."""
    return tuple(s.name for s in STAGES if s.chat_trainer)
