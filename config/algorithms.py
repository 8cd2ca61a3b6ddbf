"""What each advantage estimator (``rl.algorithm``) needs from the run: a critic, a teacher,
the reference policy, groups of responses per prompt, and the loss aggregation it pairs
with. The one declaration every check asks (the config's
validation, the memory and placement plans, the workers that start, the RL step's inputs)
instead of testing names.

- Built-ins: :data:`BUILTIN_NEEDS`, keyed by the names of
  :data:`engine.algorithms.advantages.ADVANTAGE_ESTIMATORS` (a test keeps them equal).
- Plug-ins (``rl.algorithm: package.module:function``): the module declares them next to the
  function, as a literal, e.g. ``ALGORITHM_NEEDS = {"my_fn": {"critic": True, "group": False}}``
  (:func:`declared_needs`); a function it does not name, or a module without the name, gets
  :data:`PLUGIN_NEEDS` (a group-baseline estimator without a critic, like ``grpo``). The
  declaration is read from the module's syntax tree, never by importing it (as the
  fingerprint reads ``DATA_FILES``): the config is validated by ``validate``, ``status`` and
  DVC's commands, which must not run user code; the RL driver imports the plug-in later
  (``engine.rl.plugins``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Literal, get_args

from config.module_literal import NOT_A_LITERAL, module_literal

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""The values of ``rl.loss_agg_mode`` (docs/algorithms.md, Loss aggregation)."""

LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


@dataclass(frozen=True)
class AlgorithmNeeds:
    """What an advantage estimator needs.

    Attributes:
        critic: a PPO critic (``rl.critic``, ``rl.parallel.critic``) is trained and its
            values ``[B, L]`` are passed as ``values=``; the critic learns the returns
            (``engine.rl.phases.compute_advantages``); ``rl.critic.warmup_steps`` apply.
        teacher: ``rl.teacher`` is required (and refused without this need); the teacher's and
            the old (student) log-probs ``[B, L]`` are computed before the advantages and
            passed as ``teacher_logprobs=``, ``student_logprobs=``.
        group: the advantage compares the ``rl.n_samples`` responses of one prompt, so
            ``n_samples`` must be >= 2; DAPO dynamic sampling (which drops groups of equal
            rewards) is allowed only with this need.
        reference: the reference role (the frozen starting policy, ``rl.parallel.reference``)
            runs even without a KL term (``rl.kl.coef: 0``), and its log-probs ``[B, L]`` are
            passed as ``ref_logprobs=``.
        loss_agg_mode: the ``rl.loss_agg_mode`` the estimator's source pairs it with, or None
            (any). Not enforced (an ablation may want another): ``posttrain validate`` notes
            a config that differs.
    """

    critic: bool = False
    teacher: bool = False
    group: bool = False
    reference: bool = False
    loss_agg_mode: LossAggMode | None = None


BUILTIN_NEEDS: dict[str, AlgorithmNeeds] = {
    "grpo": AlgorithmNeeds(group=True),
    # Liu et al. 2025 (arXiv:2503.20783, section 3.2): a constant normaliser, no per-response length one
    "dr_grpo": AlgorithmNeeds(group=True, loss_agg_mode="seq-mean-token-sum-norm"),
    "rloo": AlgorithmNeeds(group=True),
    "reinforce_plus_plus": AlgorithmNeeds(),  # a batch baseline, not a group's
    "reinforce_plus_plus_baseline": AlgorithmNeeds(group=True),
    "gae": AlgorithmNeeds(critic=True),
    "on_policy_distill": AlgorithmNeeds(teacher=True),
}
"""The built-in estimators' needs, in the order of ``config.rl.BuiltinAdvantage``."""

PLUGIN_NEEDS = AlgorithmNeeds(group=True)
"""The needs of a plug-in that declares none: a group-baseline estimator without a critic."""

ALGORITHM_NEEDS = "ALGORITHM_NEEDS"
"""The module-level name under which a plug-in module declares its estimators' needs."""


def names_with(need: str, value: bool = True) -> list[str]:
    """The built-in names whose ``need`` (a field of :class:`AlgorithmNeeds`) is ``value``, in table order."""
    return [name for name, needs in BUILTIN_NEEDS.items() if getattr(needs, need) == value]


def loss_pairing_note(algorithm: str, loss_agg_mode: str) -> str | None:
    """A note for ``posttrain validate`` when ``rl.loss_agg_mode`` differs from the aggregation
    ``rl.algorithm``'s needs pair it with (:attr:`AlgorithmNeeds.loss_agg_mode`); None when
    they agree or the estimator pairs with any."""
    paired = algorithm_needs(algorithm).loss_agg_mode
    if paired is None or paired == loss_agg_mode:
        return None
    return (
        f"rl.algorithm {algorithm} is paired with rl.loss_agg_mode: {paired} (its source's loss); "
        f"this config aggregates with {loss_agg_mode}"
    )


def algorithm_needs(algorithm: str) -> AlgorithmNeeds:
    """The needs of ``rl.algorithm``: a built-in's entry, or a plug-in's declaration
    (:func:`declared_needs` of its module's source file, found on ``sys.path`` without
    importing it; :data:`PLUGIN_NEEDS` when the file is not found, does not parse or declares none).

    Raises:
        KeyError: a name without a colon that is not a built-in.
        ValueError: the plug-in module's declaration is malformed (names file and line).
    """
    if ":" not in algorithm:
        return BUILTIN_NEEDS[algorithm]
    module, _, function = algorithm.partition(":")
    path = module_source(module)
    if path is None:
        return PLUGIN_NEEDS
    st = path.stat()
    try:
        declared = _declared(str(path), st.st_mtime_ns, st.st_size)
    except SyntaxError:  # the driver's import reports it, naming rl.algorithm (engine.rl.plugins)
        return PLUGIN_NEEDS
    return declared.get(function, PLUGIN_NEEDS)


def module_source(module: str) -> Path | None:
    """The source file of the dotted ``module``, found without importing it: its
    ``__file__`` when it is imported already, else the first ``<dir>/a/b.py`` or
    ``<dir>/a/b/__init__.py`` over the ``sys.path`` directories (``''`` is the working
    directory). None when none exists (e.g. a compiled or zipped module)."""
    loaded = sys.modules.get(module)
    file = getattr(loaded, "__file__", None) if loaded is not None else None
    if file:
        return Path(file)
    parts = module.split(".")
    for entry in sys.path:
        base = Path(entry or os.getcwd()).joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


@lru_cache(maxsize=64)
def _declared(path: str, mtime_ns: int, size: int) -> dict[str, AlgorithmNeeds]:
    return declared_needs(Path(path))


def declared_needs(path: Path) -> dict[str, AlgorithmNeeds]:
    """The needs a plug-in module declares at module level::

        ALGORITHM_NEEDS = {"my_estimator": {"critic": True, "group": False}}

    one entry per function name, each a literal dict of :class:`AlgorithmNeeds` fields
    (``critic``, ``teacher``, ``group``, ``reference``: bools; ``loss_agg_mode``: one of
    :data:`LOSS_AGG_MODES` or None; a field left out takes its value from
    :data:`PLUGIN_NEEDS`, so ``{"critic": True}`` still needs groups). Read from the syntax
    tree (module docstring): the value must be a literal.

    Returns: function name -> needs; empty when the module declares none.

    Raises:
        ValueError: not a literal dict of function names to dicts of known fields with
            values of their types (names the file, the line, the entry and field, and the fix).
        SyntaxError: the file does not parse.
    """
    known = [f.name for f in fields(AlgorithmNeeds)]
    found = module_literal(path, ALGORITHM_NEEDS)
    if found is None:
        return {}
    lineno, value = found
    flags = ", ".join(k for k in known if k != "loss_agg_mode")
    shape = (
        f"a literal dict of function names to dicts of needs ({flags}: True or False; loss_agg_mode: "
        f"None or one of {', '.join(LOSS_AGG_MODES)}), e.g. "
        f'{ALGORITHM_NEEDS} = {{"my_estimator": {{"critic": True}}}}'
    )
    if value is NOT_A_LITERAL:
        raise ValueError(
            f"{path}:{lineno}: {ALGORITHM_NEEDS} must be {shape}; it is read without importing the "
            "module, so it cannot be computed"
        )
    where = f"{path}:{lineno}: {ALGORITHM_NEEDS}"
    if not isinstance(value, dict):
        raise ValueError(f"{where} is a {type(value).__name__}; it must be {shape}")
    for fn, needs in value.items():
        if not isinstance(fn, str) or not isinstance(needs, dict):
            raise ValueError(f"{where}[{fn!r}]: must be a function name mapped to a dict of needs; {shape}")
        for key, v in needs.items():
            if key not in known:
                raise ValueError(f"{where}[{fn!r}]: unknown need {key!r} (known: {', '.join(known)})")
            if key == "loss_agg_mode" and not (v is None or v in LOSS_AGG_MODES):
                raise ValueError(
                    f"{where}[{fn!r}]['loss_agg_mode']: {v!r} is not None or one of {', '.join(LOSS_AGG_MODES)}"
                )
            if key != "loss_agg_mode" and not isinstance(v, bool):
                raise ValueError(f"{where}[{fn!r}][{key!r}]: {v!r} must be True or False")
    return {fn: AlgorithmNeeds(**{**PLUGIN_NEEDS.__dict__, **needs}) for fn, needs in value.items()}
