"""The precision setting: hardware detection, `auto` resolution, per-stage overrides, export dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError

import config.precision as precision
from config.load import load_config
from config.schema import PipelineConfig

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def _raw() -> dict:
    return yaml.safe_load(QUICKSTART.read_text())


@pytest.fixture
def hardware(monkeypatch):
    """Pretend to be another machine: CPU flags and CUDA capability (the only way to test a
    machine this one is not; the real probe is checked by test_probe_agrees_with_torch)."""

    def set_(flags: set[str], cuda: tuple[int, int] | None = None):
        monkeypatch.setattr(precision, "_cpu_flags", lambda: flags)
        monkeypatch.setattr(precision, "_cuda_capability", lambda: cuda)
        precision.bf16_hardware.cache_clear()

    yield set_
    precision.bf16_hardware.cache_clear()


def test_probe_agrees_with_torch():
    # Independent implementation: torch's own CPUID checks (what vLLM's CPU platform asks too).
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert not torch.cuda.is_available()
    assert precision.bf16_hardware()[0] == native
    assert precision.resolve_precision("auto") == "fp32"  # a CPU: auto is fp32 there (config.precision)


@pytest.mark.parametrize(
    "flags,cuda,native,expected",
    [
        ({"avx2", "amx_bf16", "avx512_bf16"}, None, True, "fp32"),  # Sapphire Rapids: native, yet auto is fp32 on CPU
        ({"avx2", "avx512f", "avx512_bf16"}, None, True, "fp32"),  # Zen 4: the same
        ({"avx2", "avx512f"}, None, False, "fp32"),  # Skylake: no bf16 instructions
        ({"avx2"}, (8, 0), True, "bf16"),  # A100: the GPU decides
        ({"avx2", "amx_bf16"}, (7, 0), False, "fp32"),  # V100 has no bf16 tensor cores
    ],
)
def test_auto_follows_the_hardware(hardware, flags, cuda, native, expected):
    hardware(flags, cuda)
    assert precision.resolve_precision("auto") == expected
    assert precision.resolve_precision(None) == expected
    assert precision.resolve_precision("fp32") == "fp32" and precision.resolve_precision("bf16") == "bf16"
    has, why = precision.bf16_hardware()
    assert has == native and why  # a reason to log
    resolved, reason = precision.auto_precision()
    assert resolved == expected and reason.startswith(why)
    assert reason.endswith("; auto is fp32 on CPU") == (cuda is None)


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="'bf16', 'fp32' or 'auto'"):
        precision.resolve_precision("fp16")


def test_config_resolves_every_stage_and_the_export_dtype(hardware):
    hardware({"avx2"}, (9, 0))
    cfg = PipelineConfig.model_validate(_raw())
    assert cfg.run.precision == "auto"
    assert (cfg.sft.precision, cfg.rm.precision, cfg.rl.precision, cfg.evaluate.precision) == ("bf16",) * 4
    assert cfg.export.dtype == "bfloat16"  # the quickstart leaves it null: the RL stage's precision
    hardware({"avx2"})
    cfg = PipelineConfig.model_validate(_raw())
    assert (cfg.sft.precision, cfg.rl.precision, cfg.export.dtype) == ("fp32", "fp32", "float32")


def test_stage_overrides_and_explicit_export_dtype(hardware):
    hardware({"avx2"})
    raw = _raw()
    raw["run"]["precision"] = "bf16"
    raw["rm"]["precision"] = "fp32"
    raw["export"]["dtype"] = "float16"
    cfg = PipelineConfig.model_validate(raw)
    assert (cfg.sft.precision, cfg.rm.precision, cfg.rl.precision) == ("bf16", "fp32", "bf16")
    assert cfg.export.dtype == "float16"
    # A resolved config round-trips: dumping and reloading gives the same settings.
    assert PipelineConfig.model_validate(cfg.model_dump()) == cfg


def test_precision_enters_the_fingerprint(hardware):
    from tasks.graph import STAGES

    specs = {spec.name: spec for spec, _ in STAGES}
    raw = _raw()
    fp32 = PipelineConfig.model_validate({**raw, "run": {**raw["run"], "precision": "fp32"}})
    bf16 = PipelineConfig.model_validate({**raw, "run": {**raw["run"], "precision": "bf16"}})
    for stage in ("sft", "rm", "rl", "evaluate", "export"):
        assert specs[stage].config(fp32) != specs[stage].config(bf16), stage
    assert specs["validate"].config(fp32) == specs["validate"].config(bf16)


def test_params_dtype_names_its_replacement(tmp_path):
    raw = _raw()
    raw["convert"] = {"params_dtype": "bfloat16"}
    with pytest.raises(ValidationError, match="run.precision"):
        PipelineConfig.model_validate(raw)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(Exception, match="convert.*params_dtype.*run.precision"):
        load_config(str(path))


def test_bad_precision_value_names_the_key(tmp_path):
    raw = _raw()
    raw["rl"]["precision"] = "half"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(Exception, match=r"rl\.precision"):
        load_config(str(path))
