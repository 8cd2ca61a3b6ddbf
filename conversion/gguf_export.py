"""Export an HF model directory (llama, qwen2, qwen3) as a GGUF file for llama.cpp and Ollama.

Follows llama.cpp's ``convert_hf_to_gguf.py``: tensor names from ``conversion.gguf``'s maps
(the one place that knows HF <-> GGUF names), the llama q/k row permutation
(:func:`conversion.gguf.permute_qk`), 1-D tensors (norms, biases) kept F32, and a tensor
whose rows do not split into 32-value blocks written F16 where Q8_0 was asked (as
llama.cpp does on ``QuantError``). The tokenizer goes into the metadata: tokens, token
types, SentencePiece scores or BPE merges, ``tokenizer.ggml.model``/``pre``, the chat
template and the bos/eos/unk/padding ids and the end-of-turn id (``eot``).

Measured by tests/conversion/test_gguf_export.py (our import of the written file against
the exported model, float32 logits of tiny models): ``f32`` exact, ``f16`` max |diff|
below 2e-3, ``bf16`` below 2e-2, ``q8_0`` below 3e-2.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conversion.gguf import GGUF_ARCHITECTURES, GLOBAL_NAMES, LAYER_NAMES, PERMUTED, permute_qk
from conversion.hf_source import load_hf_source
from conversion.registry import family

# --type -> (GGML tensor type of 2-D weights, general.file_type as llama.cpp's LlamaFileType)
GGUF_TYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
}
# tokenizer.ggml.pre of a byte-level BPE vocabulary, by architecture: what llama.cpp's converter
# finds for these families' tokenizers (Qwen2/2.5/3 share one; Llama 3 is "llama-bpe").
BPE_PRE_TOKENIZERS = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}
_HF_TO_GGUF = {v: k for k, v in GLOBAL_NAMES.items()}
_HF_LAYER_TO_GGUF = {v: k for k, v in LAYER_NAMES.items()}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_MARK = "\x07posttrain-turn\x07"  # an assistant reply no template rewrites


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name of an HF tensor name (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``), from ``conversion.gguf``'s maps.

    Raises:
        ValueError: a name that has no GGUF counterpart (named).
    """
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    m = _LAYER.fullmatch(hf_name)
    if m and m.group(2) in _HF_LAYER_TO_GGUF:
        return f"blk.{m.group(1)}.{_HF_LAYER_TO_GGUF[m.group(2)]}"
    raise ValueError(f"tensor {hf_name!r} has no GGUF name (conversion.gguf.LAYER_NAMES)")


def _encode(a: np.ndarray, kind: str) -> tuple[np.ndarray, Any]:
    """(data, raw_dtype) for ``GGUFWriter.add_tensor``; 1-D tensors stay F32, Q8_0 falls back
    to F16 for rows not a multiple of the 32-value block (llama.cpp's converter does both)."""
    # gguf: ~1 s to import; only GGUF files need it
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim == 1 or kind == "F32":
        return a, None
    if kind == "Q8_0" and a.shape[-1] % 32:
        kind = "F16"
    if kind == "F16":
        return a.astype(np.float16), None
    return quantize(a, Q[kind]), Q[kind]


def _token_id(tok, text: str | None) -> int | None:
    return None if text is None else tok.convert_tokens_to_ids(text)


def _turn_end_id(tok) -> int | None:
    """The token the chat template closes an assistant turn with (Qwen ``<|im_end|>``, Llama 3
    ``<|eot_id|>``), found by rendering one turn: the first token after the reply, if it is a
    special token. None without a template or if the template writes no such token."""
    if not isinstance(getattr(tok, "chat_template", None), str):
        return None
    try:
        text = tok.apply_chat_template(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _MARK}], tokenize=False
        )
    except Exception:  # a template that needs more than plain turns (tools, a system turn): no eot
        return None
    after = text[text.find(_MARK) + len(_MARK) :] if _MARK in text else ""
    ids = tok(after, add_special_tokens=False).input_ids if after.strip() else []
    return ids[0] if ids and ids[0] in set(tok.all_special_ids) | _special_added(tok) else None


def _special_added(tok) -> set[int]:
    return {i for i, t in tok.added_tokens_decoder.items() if t.special}


def tokenizer_metadata(tokenizer_dir: str | Path, architecture: str, vocab_size: int) -> dict[str, Any]:
    """The GGUF tokenizer metadata of an HF tokenizer (llama.cpp ``convert_hf_to_gguf.py``
    ``_set_vocab_sentencepiece`` / ``_set_vocab_gpt2`` conventions).

    A byte-fallback BPE with a Metaspace (``▁``) pre-tokenizer is written as SentencePiece
    (``model`` "llama"): a token's score is minus its place in the order the merges first
    make tokens, then the other normal pieces in id order (0 for special and byte tokens), the order llama.cpp's SentencePiece tokenizer
    merges in (so a SentencePiece GGUF imported here writes back its own scores); types UNKNOWN/CONTROL/BYTE/NORMAL. A byte-level BPE is written as ``model`` "gpt2"
    with its merges and ``pre`` from :data:`BPE_PRE_TOKENIZERS`; added tokens are CONTROL
    (special) or USER_DEFINED. Ids past the tokenizer's up to ``vocab_size`` become
    ``[PAD{i}]`` (UNUSED), as llama.cpp pads them.

    Returns:
        dict with model, pre, tokens, token_types (ints), scores (or None), merges (or
        None), ids (bos/eos/unk/pad/eot -> id or None), add_bos, add_eos, chat_template.

    Raises:
        ValueError: another tokenizer model (Unigram, WordPiece), or more tokens than
            ``vocab_size`` (naming the directory).
    """
    # transformers and gguf: 1-2 s to import; only tokenizers and HF models need it
    from gguf import TokenType
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    backend = json.loads(tok.backend_tokenizer.to_str())
    model = backend["model"]
    pre = json.dumps(backend.get("pre_tokenizer"), ensure_ascii=False)
    if model["type"] == "BPE" and "ByteLevel" in pre:
        kind = "gpt2"
    elif (
        model["type"] == "BPE"
        and model.get("byte_fallback")
        and "\u2581" in pre + json.dumps(backend.get("normalizer"), ensure_ascii=False)
    ):
        kind = "llama"
    else:
        raise ValueError(
            f"{tokenizer_dir}: tokenizer model {model['type']!r} (pre-tokenizer {pre[:80]}) has no GGUF "
            "writer here; supported: SentencePiece-style BPE with byte fallback, byte-level BPE"
        )
    vocab = tok.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ValueError(
            f"{tokenizer_dir}: the tokenizer has token id {max(vocab.values())}, outside the model's "
            f"vocab_size {vocab_size} (config.json)"
        )
    by_id = {i: t for t, i in vocab.items()}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    added = tok.added_tokens_decoder
    special = _special_added(tok) | set(tok.all_special_ids)
    tokens: list[str] = []
    types: list[TokenType] = []
    scores: list[float] | None = [] if kind == "llama" else None
    if kind == "llama":  # tokens in the order merges first make them (dense: one merge list may
        first: dict[str, int] = {}  # hold several ways to make a token)
        for r, m in enumerate(merges):
            first.setdefault(m.replace(" ", ""), r)
        rank = {t: n for n, t in enumerate(sorted(first, key=first.__getitem__))}
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(text)
            if i == tok.unk_token_id:
                types.append(TokenType.UNKNOWN)
            elif i in special:
                types.append(TokenType.CONTROL)
            elif i in added:
                types.append(TokenType.USER_DEFINED)
            elif kind == "llama" and _BYTE_TOKEN.fullmatch(text):
                types.append(TokenType.BYTE)
            else:
                types.append(TokenType.NORMAL)
        if scores is not None:  # pieces no merge makes (characters) follow, in id order
            normal = text is not None and types[-1] == TokenType.NORMAL
            scores.append(-float(rank.setdefault(text, len(rank))) if text is not None and normal else 0.0)
    probe = tok("a").input_ids
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    return {
        "model": kind,
        "pre": BPE_PRE_TOKENIZERS[architecture] if kind == "gpt2" else None,
        "tokens": tokens,
        "token_types": [int(t) for t in types],
        "scores": scores,
        "merges": merges if kind == "gpt2" else None,
        "ids": {
            "bos": tok.bos_token_id,
            "eos": tok.eos_token_id,
            "unk": tok.unk_token_id,
            "pad": tok.pad_token_id,
            "eot": _turn_end_id(tok),
        },
        "add_bos": bool(probe) and tok.bos_token_id is not None and probe[0] == tok.bos_token_id,
        "add_eos": bool(probe) and tok.eos_token_id is not None and probe[-1] == tok.eos_token_id,
        "chat_template": template,
    }


def _add_tokenizer(w, meta: dict[str, Any]) -> None:
    w.add_tokenizer_model(meta["model"])
    if meta["pre"]:
        w.add_tokenizer_pre(meta["pre"])
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["token_types"])
    if meta["scores"] is not None:
        w.add_token_scores(meta["scores"])
    if meta["merges"] is not None:
        w.add_token_merges(meta["merges"])
    for key, value in meta["ids"].items():
        if value is not None:
            getattr(w, {"unk": "add_unk_token_id", "pad": "add_pad_token_id"}.get(key, f"add_{key}_token_id"))(value)
    w.add_add_bos_token(meta["add_bos"])
    w.add_add_eos_token(meta["add_eos"])
    if meta["chat_template"]:
        w.add_chat_template(meta["chat_template"])


def hf_to_gguf(model_dir: str | Path, out_file: str | Path, gguf_type: str = "q8_0", name: str | None = None) -> Path:
    """Write an HF model directory as one GGUF file (written to a temporary sibling, then renamed).

    Args:
        model_dir: HF directory (config.json, SafeTensors weights, tokenizer files) of a
            ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``.
        out_file: the ``.gguf`` path (replaced if present).
        gguf_type: one of :data:`GGUF_TYPES` (2-D weights' type; norms and biases stay F32).
        name: ``general.name`` (default: the directory's name).

    Returns:
        ``Path(out_file)``.

    Raises:
        ValueError: unknown ``gguf_type``, an architecture without a GGUF map, rotary scaling,
            an unsupported tokenizer (each naming the key or file and the choices).
        FileNotFoundError / ConversionError: as ``conversion.hf_source.load_hf_source`` and
            ``conversion.registry.family``.
    """
    # gguf: ~1 s to import; only GGUF files need it
    import gguf

    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"GGUF type {gguf_type!r} is not supported; choose one of {', '.join(GGUF_TYPES)}")
    src = load_hf_source(model_dir)
    archs = src.config.get("architectures") or []
    arch = {v: k for k, v in GGUF_ARCHITECTURES.items()}.get(archs[0]) if archs else None
    if arch is None:
        raise ValueError(
            f"{model_dir}/config.json: 'architectures'={archs!r} has no GGUF writer; "
            f"supported: {', '.join(GGUF_ARCHITECTURES.values())}"
        )
    spec, fam = family(src.config)
    if spec.rope_scaling_factor is not None:
        raise ValueError(
            f"{model_dir}/config.json: rotary scaling (rope_scaling factor {spec.rope_scaling_factor}) "
            "is not written to GGUF here; export without it"
        )
    state = {k: v for k, v in src.state.items() if k in fam.hf_shapes(spec)}
    meta = tokenizer_metadata(src.tokenizer_dir, arch, spec.vocab_size)
    kind, file_type = GGUF_TYPES[gguf_type]
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    w = gguf.GGUFWriter(str(tmp), arch)
    try:
        w.add_name(name or Path(model_dir).resolve().name)
        w.add_context_length(spec.max_position_embeddings)
        w.add_embedding_length(spec.hidden_size)
        w.add_feed_forward_length(spec.ffn_hidden_size)
        w.add_block_count(spec.num_layers)
        w.add_head_count(spec.num_attention_heads)
        w.add_head_count_kv(spec.num_key_value_heads)
        w.add_key_length(spec.kv_channels)
        w.add_value_length(spec.kv_channels)
        w.add_rope_dimension_count(spec.kv_channels)
        w.add_rope_freq_base(spec.rope_theta)
        w.add_layer_norm_rms_eps(spec.norm_epsilon)
        w.add_file_type(int(gguf.LlamaFileType[file_type]))
        if kind == "Q8_0":
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_tokenizer(w, meta)
        heads = dict(zip(PERMUTED, (spec.num_attention_heads, spec.num_key_value_heads)))
        for hf_name, t in state.items():
            gname = gguf_tensor_name(hf_name)
            t = t.detach().to(torch.float32)
            if arch == "llama" and gname.split(".", 2)[-1] in heads:
                t = permute_qk(t, heads[gname.split(".", 2)[-1]])
            data, raw = _encode(t.numpy(), kind)
            w.add_tensor(gname, data, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out
