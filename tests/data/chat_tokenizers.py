"""Tokenizers for the real chat templates of ../shared/fixtures (test helper, not a test module).

The Gemma, NVIDIA-Mistral and Phi-4 fixtures are ``tokenizer_config.json`` files only (chat
template, special tokens, eos; no vocabulary). :func:`paired_tokenizer` pairs one with a real
vocabulary that is given the template's added tokens (``added_tokens_decoder``: special ones
as special tokens, the others as plain added tokens; the 986 ``<SPECIAL_n>`` placeholders of
the Mistral config are left out), its bos/eos/pad/unk and its chat template:

- ``"bpe"``: the Qwen2.5 byte-level BPE vocabulary (vocab.json + merges.txt);
- ``"sentencepiece"``: the stories260K Llama tokenizer imported from its GGUF file
  (SentencePiece BPE with byte fallback, Metaspace ``prepend_scheme: first``: a string of its
  own starts with a ``▁`` word marker), the style of Llama / Gemma / Mistral tokenizers.

:func:`with_token_flags` gives a tokenizer's added tokens ``rstrip`` / ``lstrip`` flags, as
tokenizer.json declares them for Phi-3's and Phi-4's role and turn-end tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

# transformers 5's model-specific classes (Qwen2Tokenizer) rebuild the backend from the
# vocabulary and merges and drop added tokens' strip flags; the generic class loads
# tokenizer.json as written.
GENERIC_CLASS = "PreTrainedTokenizerFast"

FAMILIES = ("gemma", "nvidia-mistral", "phi-4")
BASES = ("bpe", "sentencepiece")


def template_config(fixtures_dir: Path, family: str) -> dict:
    return json.loads(
        (fixtures_dir / "chat-tokenizers" / "templates-only" / family / "tokenizer_config.json").read_text()
    )


def sentencepiece_dir(fixtures_dir: Path, out_dir: Path) -> Path:
    """The stories260K tokenizer (HF files) written under ``out_dir`` (kept if present)."""
    from conversion.gguf import gguf_to_hf

    if not (out_dir / "tokenizer.json").is_file():
        gguf_to_hf(fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf", out_dir)
    return out_dir


def paired_tokenizer(fixtures_dir: Path, family: str, base_dir: Path):
    """A tokenizer with ``family``'s chat template and added tokens on the vocabulary in ``base_dir``."""
    cfg = template_config(fixtures_dir, family)
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    added = cfg["added_tokens_decoder"].values()
    special = [t["content"] for t in added if t["special"] and not t["content"].startswith("<SPECIAL_")]
    plain = [t["content"] for t in added if not t["special"]]
    tok.add_special_tokens({"additional_special_tokens": special})
    if plain:
        tok.add_tokens(plain)
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if cfg.get(key):
            setattr(tok, key, cfg[key])
    tok.chat_template = cfg["chat_template"]
    return tok


def every_template_tokenizer(fixtures_dir: Path, sp_dir: Path) -> dict:
    """``{(family, base): tokenizer}``: Qwen2.5 and Qwen3 on their own vocabulary, and every
    other family's template on both the byte-level BPE and the SentencePiece vocabulary."""
    qwen_dir = fixtures_dir / "qwen2.5-tokenizer"
    out = {("qwen2.5", "bpe"): AutoTokenizer.from_pretrained(qwen_dir)}
    qwen3 = AutoTokenizer.from_pretrained(qwen_dir)
    qwen3.chat_template = json.loads((qwen_dir / "qwen3" / "tokenizer_config.json").read_text())["chat_template"]
    out[("qwen3", "bpe")] = qwen3
    for family in FAMILIES:
        for base, path in (("bpe", qwen_dir), ("sentencepiece", sp_dir)):
            out[(family, base)] = paired_tokenizer(fixtures_dir, family, path)
    return out


def with_token_flags(tok, out_dir: Path, flags: dict[str, dict[str, bool]]):
    """``tok`` saved to ``out_dir`` with ``flags`` (token content -> ``{"rstrip": True}`` etc.)
    set on those added tokens in tokenizer.json's ``added_tokens`` and in tokenizer_config.json's
    ``added_tokens_decoder`` (when it has one), then loaded back from ``out_dir``
    (tokenizer_class :data:`GENERIC_CLASS`, which keeps the flags)."""
    tok.save_pretrained(out_dir)
    data = json.loads((out_dir / "tokenizer.json").read_text())
    for token in data["added_tokens"]:
        token.update(flags.get(token["content"], {}))
    (out_dir / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    for token in (cfg.get("added_tokens_decoder") or {}).values():
        token.update(flags.get(token["content"], {}))
    cfg["tokenizer_class"] = GENERIC_CLASS
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return AutoTokenizer.from_pretrained(out_dir)
