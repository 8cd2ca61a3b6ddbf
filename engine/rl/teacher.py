"""The teacher of on-policy distillation (``rl.teacher``): checked against the student before
any worker starts, since its per-token log-probs only mean something over the student's tokens."""

from __future__ import annotations

from pathlib import Path


def check_teacher(student_dir: str | Path, teacher_dir: str | Path) -> None:
    """Raise unless the teacher's model directory can score the student's tokens: both
    ``hf/config.json`` ``vocab_size`` equal and both tokenizers mapping the same strings to
    the same ids (``get_vocab()``, added tokens included) with the same EOS token.

    Raises:
        FileNotFoundError: ``teacher_dir`` is not a model directory (names ``rl.teacher.model_dir``).
        ValueError: the vocabularies differ; names both directories and the first difference.
    """
    # torch (via engine.storage.model_dir): seconds to import, not paid until this runs
    from engine.storage.model_dir import load_tokenizer, read_hf_config

    key = f"rl.teacher.model_dir {teacher_dir}"
    try:
        teacher_cfg, teacher_tok = read_hf_config(teacher_dir), load_tokenizer(teacher_dir)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{key}: not a model directory ({exc})") from exc
    student_cfg, student_tok = read_hf_config(student_dir), load_tokenizer(student_dir)
    differ = f"{key} and the student {student_dir} do not share a tokenizer"
    if teacher_cfg.get("vocab_size") != student_cfg.get("vocab_size"):
        raise ValueError(
            f"{differ}: hf/config.json vocab_size {teacher_cfg.get('vocab_size')} (teacher) vs "
            f"{student_cfg.get('vocab_size')} (student)"
        )
    teacher_vocab, student_vocab = teacher_tok.get_vocab(), student_tok.get_vocab()
    if teacher_vocab != student_vocab:
        token = min(set(teacher_vocab.items()) ^ set(student_vocab.items()))[0]
        raise ValueError(
            f"{differ}: token {token!r} has id {teacher_vocab.get(token)} in the teacher's vocabulary and "
            f"{student_vocab.get(token)} in the student's ({len(teacher_vocab)} vs {len(student_vocab)} "
            "tokens)"
        )
    if teacher_tok.eos_token != student_tok.eos_token:
        raise ValueError(
            f"{differ}: EOS token {teacher_tok.eos_token!r} (teacher) vs {student_tok.eos_token!r} (student)"
        )
