"""tasks.graph against the stage registry (config.stages): each entry paired with its module's
StageSpec and Prefect task, a spec reads only the upstream stages the registry declares, and
the stages with training curves are registry stages."""

from __future__ import annotations

import importlib
import itertools
import sys
import types
from pathlib import Path

import pytest

from config import load_config, stages
from tasks import graph

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def test_each_registry_stage_is_paired_with_its_module_spec_and_task():
    assert graph.STAGE_NAMES == list(stages.stage_names())
    for entry, (spec, task) in zip(stages.STAGES, graph.STAGES, strict=True):
        module = importlib.import_module(f"tasks.{entry.name}")
        assert spec is module.SPEC and task is getattr(module, entry.name)
        assert graph.stage(entry.name) == (spec, task)


def test_a_stage_module_without_spec_or_with_another_name_is_refused(monkeypatch):
    with pytest.raises(
        ImportError,
        match=r"tasks/artifacts.py: stage 'artifacts' \(config/stages.py\) needs a "
        r"StageSpec `SPEC` and its Prefect task `artifacts`",
    ):
        graph._implementation(stages.Stage("artifacts"))
    # A module whose SPEC names another stage cannot be made from the real ones without editing
    # them, so a stand-in module is registered for the duration of the test.
    fake = types.ModuleType("tasks.fake")
    fake.SPEC, fake.fake = graph.stage("validate")
    monkeypatch.setitem(sys.modules, "tasks.fake", fake)
    with pytest.raises(ValueError, match="tasks/fake.py: SPEC.name is 'validate', not the stage's name 'fake'"):
        graph._implementation(stages.Stage("fake"))


def test_each_spec_reads_only_the_upstream_stages_the_registry_declares():
    cfg = load_config(QUICKSTART)
    seen: dict[str, set[str]] = {name: set() for name in stages.stage_names()}
    for sft, rm, po, weight in itertools.product((True, False), (True, False), (True, False), (0.0, 0.5)):
        update = {
            k: getattr(cfg, k).model_copy(update={"enabled": v}) for k, v in (("sft", sft), ("rm", rm), ("po", po))
        }
        update["rl"] = cfg.rl.model_copy(
            update={"reward": cfg.rl.reward.model_copy(update={"reward_model_weight": weight})}
        )
        variant = cfg.model_copy(update=update)
        enabled = [s.name for s in stages.enabled(variant)]
        assert [spec.name for spec, _ in graph.enabled_stages(variant)] == enabled
        for spec, _ in graph.enabled_stages(variant):
            ups = spec.inputs(variant)
            assert set(ups) <= set(stages.get(spec.name).inputs), (spec.name, ups)
            assert set(ups) <= set(enabled[: enabled.index(spec.name)]), (spec.name, ups)  # an enabled earlier stage
            seen[spec.name].update(ups)
    # and the registry declares no input that no setting reads
    assert seen == {s.name: set(s.inputs) for s in stages.STAGES}


def test_the_stages_with_training_curves_are_registry_stages_in_run_order():
    from engine.evaluation.curves import STAGE_PANELS

    names = stages.stage_names()
    assert list(STAGE_PANELS) == [n for n in names if n in STAGE_PANELS] == ["sft", "rm", "po", "rl"]
