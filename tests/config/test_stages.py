"""The stage registry (config.stages): its declarations against the config sections they
describe, its derived lists, and the checks that refuse a malformed registry."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from config import stages
from config.load import load_config
from config.parallel import ParallelConfig
from config.schema import PRECISION_STAGES, PipelineConfig

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def _switched(cfg: PipelineConfig, **on: bool) -> PipelineConfig:
    return cfg.model_copy(update={k: getattr(cfg, k).model_copy(update={"enabled": v}) for k, v in on.items()})


def test_the_derived_lists_are_the_pipelines():
    assert stages.stage_names() == ("validate", "convert", "sft", "rm", "po", "rl", "evaluate", "export")
    assert stages.policy_chain() == ("convert", "sft", "po", "rl", "export")
    assert stages.precision_stages() == PRECISION_STAGES == ("sft", "rm", "po", "rl", "evaluate")
    assert stages.switchable() == stages.chat_trainers() == ("sft", "rm", "po")
    assert [s.name for s in stages.STAGES if not s.inputs] == ["validate", "convert"]


def test_each_declaration_matches_its_config_sections():
    fields = PipelineConfig.model_fields
    for s in stages.STAGES:
        assert s.sections and all(sec in fields for sec in s.sections), s.name
        section = fields[s.name].annotation if s.name in fields else None
        if s.switch is not None:
            assert "enabled" in fields[s.switch].annotation.model_fields, s.name
        assert (section is not None and "precision" in section.model_fields) == s.precision, s.name
        if s.chat_trainer:
            assert {"max_seq_len", "parallel"} <= set(section.model_fields), s.name
            assert section.model_fields["parallel"].annotation is ParallelConfig, s.name
    # a section with `enabled` at its top is a stage's switch (rl's dynamic_sampling.enabled is nested)
    with_switch = {
        name
        for name, f in fields.items()
        if hasattr(f.annotation, "model_fields") and "enabled" in f.annotation.model_fields
    }
    assert {s.switch for s in stages.STAGES if s.switch} == with_switch - {"wandb"}


def test_enabled_follows_the_switches():
    cfg = load_config(QUICKSTART)
    for sft, rm, po in itertools.product((True, False), repeat=3):
        c = _switched(cfg, sft=sft, rm=rm, po=po)
        expected = [
            "validate",
            "convert",
            *(["sft"] if sft else []),
            *(["rm"] if rm else []),
            *(["po"] if po else []),
            "rl",
            "evaluate",
            "export",
        ]
        assert [s.name for s in stages.enabled(c)] == expected
        assert [n for n in ("prepare", *stages.stage_names()) if stages.is_enabled(c, n)] == ["prepare", *expected]


def test_policy_before_is_the_newest_enabled_policy_stage():
    cfg = load_config(QUICKSTART)
    # (sft on, po on) -> what rm/po and rl start from (tasks.runner.starting_policy, rl_starting_policy)
    table = {
        (True, True): ("sft", "po"),
        (True, False): ("sft", "sft"),
        (False, True): ("convert", "po"),
        (False, False): ("convert", "convert"),
    }
    for (sft, po), (first, rl) in table.items():
        c = _switched(cfg, sft=sft, po=po)
        assert (stages.policy_before(c, "rm"), stages.policy_before(c, "po")) == (first, first)
        assert stages.policy_before(c, "rl") == rl
        assert stages.policy_before(c, "evaluate") == stages.policy_before(c, "export") == "rl"
    with pytest.raises(ValueError, match="'convert' has no enabled policy stage before it"):
        stages.policy_before(cfg, "convert")
    with pytest.raises(KeyError, match="unknown stage 'prepare'; stages are: validate, convert, sft"):
        stages.policy_before(cfg, "prepare")


def test_a_malformed_registry_is_refused():
    ok = (stages.Stage("validate"), stages.Stage("sft", inputs=("validate",)))
    stages._check(ok)
    with pytest.raises(ValueError, match=r"stage 'sft' has inputs \['rl'\] that are not earlier stages"):
        stages._check((*ok[:1], stages.Stage("sft", inputs=("validate", "rl")), stages.Stage("rl")))
    with pytest.raises(ValueError, match="stage 'validate' is declared twice"):
        stages._check((*ok, stages.Stage("validate")))
