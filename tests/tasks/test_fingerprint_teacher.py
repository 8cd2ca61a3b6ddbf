"""The teacher of on-policy distillation (rl.teacher.model_dir) enters the rl fingerprint by
its content: retraining the teacher retrains rl; moving it does not."""

from __future__ import annotations

import shutil

from config.schema import PipelineConfig
from tasks import rl


def _cfg(teacher_dir) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "run": {"name": "t"},
            "data": {},
            "model": {"source": "m"},
            "rl": {"algorithm": "on_policy_distill", "teacher": {"model_dir": str(teacher_dir)}},
        }
    )


def test_the_teachers_content_is_in_the_rl_fingerprint_and_its_place_is_not(tmp_path):
    teacher = tmp_path / "teacher"
    (teacher / "megatron").mkdir(parents=True)
    (teacher / "megatron" / "weights.distcp").write_bytes(b"\x00" * 16)
    (teacher / "hf").mkdir()
    (teacher / "hf" / "config.json").write_text('{"vocab_size": 280}')
    ups = {"validate": "v" * 64, "sft": "s" * 64}
    cfg = _cfg(teacher)
    assert rl._reward_plugin_files(cfg) == {"teacher": str(teacher)}
    before = rl.SPEC.fingerprint(cfg, ups)
    assert rl.SPEC.fingerprint(cfg, ups) == before  # stable
    moved = shutil.copytree(teacher, tmp_path / "elsewhere" / "teacher_copy")
    assert rl.SPEC.fingerprint(_cfg(moved), ups) == before  # by content, not by path
    (teacher / "megatron" / "weights.distcp").write_bytes(b"\x01" * 16)  # a retrained teacher
    assert rl.SPEC.fingerprint(cfg, ups) != before
    kl = PipelineConfig.model_validate(
        {**cfg.model_dump(), "rl": {**cfg.rl.model_dump(), "teacher": {"model_dir": str(moved), "kl_coef": 2.0}}}
    )
    assert rl.SPEC.fingerprint(kl, ups) != rl.SPEC.fingerprint(_cfg(moved), ups)  # its settings too
