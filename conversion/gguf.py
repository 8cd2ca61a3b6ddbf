"""Import a GGUF file (llama.cpp format; llama, qwen2, qwen3) as an HF model directory.

Reads the file with the ``gguf`` package (llama.cpp's reader) and writes config.json,
model.safetensors (fp32), the tokenizer files and generation_config.json. The name maps
here (:data:`GGUF_ARCHITECTURES`, :data:`GLOBAL_NAMES`, :data:`LAYER_NAMES`) are the one
place that knows HF <-> GGUF names; ``conversion.gguf_export`` uses them in reverse.

Three things differ from the HF layout:

- llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that its rotary
  embedding, which rotates adjacent pairs (x[2i], x[2i+1]), matches HF's rotate-half
  layout (x[i], x[i + d/2]); see ``permute`` in llama.cpp ``convert_hf_to_gguf.py``.
  :func:`unpermute_qk` is its inverse.
- Special-token ids may hold the uint32 "none" sentinel 4294967295 (stories260K's padding
  and separator ids); those are treated as absent.
- The tokenizer is stored as a SentencePiece vocabulary (``tokenizer.ggml.model`` "llama":
  tokens, scores, types) or a byte-level BPE one ("gpt2": tokens, types, merges and the
  pre-tokenizer's name); it is rebuilt with transformers' GGUF tokenizer conversion on the
  corrected metadata.

Tensors may be F32, F16, BF16 or Q8_0 (dequantized with ``gguf.quants.dequantize``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from conversion.export import write_hf_safetensors
from conversion.registry import ConversionError, family
from conversion.spec import GPTSpec

NO_TOKEN_IDS = (0xFFFFFFFF, -1)  # llama.cpp's "no token" (LLAMA_TOKEN_NULL / uint32 max)
_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0")
# general.architecture -> HF architectures[0] (llama.cpp convert_hf_to_gguf.py LlamaModel,
# Qwen2Model, Qwen3Model).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TOKENIZER_MODELS = ("llama", "gpt2")  # tokenizer.ggml.model: SentencePiece, byte-level BPE

# GGUF tensor name -> HF name; layer tensors are "blk.{i}.<key>" <-> "model.layers.{i}.<value>".
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # qwen2 (and qwen3 with attention_bias): q/k/v biases; qwen3: o_proj bias, per-head q/k norms
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
PERMUTED = ("attn_q.weight", "attn_k.weight")  # llama only: rotary layout of the q/k rows


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: GGUF (pairwise rotary) -> HF (rotate-half) rows.

    llama.cpp applies ``w.reshape(h, 2, r // h // 2, c).swapaxes(1, 2)``; this applies the
    inverse, ``w.reshape(h, r // h // 2, 2, c).swapaxes(1, 2)``.

    Args:
        w: ``[num_heads * head_dim, in]`` projection weight.
        num_heads: heads of this projection (query heads for q, KV heads for k).
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation, HF (rotate-half) -> GGUF (pairwise rotary) rows:
    ``w.reshape(h, 2, r // h // 2, c).swapaxes(1, 2)`` (convert_hf_to_gguf.py
    ``LlamaModel.permute``); the inverse of :func:`unpermute_qk`. Shapes as there."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _Gguf:
    """Metadata access with errors naming the file and key."""

    def __init__(self, path: Path):
        # gguf: ~1 s to import; only GGUF files need it
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(str(path))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return value

    def token_id(self, key: str, vocab_size: int) -> int | None:
        value = self.get(key)
        if value is None or value in NO_TOKEN_IDS:
            return None
        if not 0 <= value < vocab_size:
            raise ValueError(
                f"{self.path}: GGUF metadata key {key!r}={value} is outside the vocabulary [0, {vocab_size})"
            )
        return int(value)


def _tensor(g: _Gguf, t) -> torch.Tensor:
    kind = t.tensor_type.name
    if kind not in _SUPPORTED_TYPES:
        raise ValueError(
            f"{g.path}: tensor {t.name!r} has type {kind}; only {', '.join(_SUPPORTED_TYPES)} are supported "
            "(dequantize with llama.cpp first)"
        )
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    data = np.ascontiguousarray(t.data)
    if kind == "Q8_0":
        # gguf: ~1 s to import; only GGUF files need it
        from gguf.quants import dequantize

        out = torch.from_numpy(dequantize(data, t.tensor_type).astype(np.float32))
    elif kind == "BF16":  # the reader hands BF16 over as raw bytes
        out = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    else:
        out = torch.from_numpy(data.copy())
    return out.reshape(shape).to(torch.float32)


def _read_config(g: _Gguf) -> tuple[dict[str, Any], dict[str, Any]]:
    """(HF config dict, tokenizer metadata) of a llama, qwen2 or qwen3 GGUF; errors name the key."""
    arch = g.need("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{g.path}: GGUF key 'general.architecture'={arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    tok_model = g.need("tokenizer.ggml.model")
    if tok_model not in TOKENIZER_MODELS:
        raise ValueError(
            f"{g.path}: GGUF key 'tokenizer.ggml.model'={tok_model!r}; supported: 'llama' (SentencePiece), "
            "'gpt2' (byte-level BPE)"
        )
    tokens = g.need("tokenizer.ggml.tokens")
    vocab = len(tokens)
    hidden, heads = int(g.need(f"{arch}.embedding_length")), int(g.need(f"{arch}.attention.head_count"))
    head_dim = int(g.get(f"{arch}.attention.key_length", hidden // heads))
    for key in (f"{arch}.rope.dimension_count", f"{arch}.attention.value_length"):
        if int(g.get(key, head_dim)) != head_dim:
            raise ValueError(f"{g.path}: GGUF key {key!r}={g.get(key)} != head_dim {head_dim} (not supported)")
    scaling = g.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{g.path}: GGUF key '{arch}.rope.scaling.type'={scaling!r} is not supported")
    names = {t.name for t in g.reader.tensors}
    bias = arch == "qwen2" or "blk.0.attn_q.bias" in names
    spec = GPTSpec(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(g.need(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(g.get(f"{arch}.attention.head_count_kv", heads)),
        ffn_hidden_size=int(g.need(f"{arch}.feed_forward_length")),
        max_position_embeddings=int(g.need(f"{arch}.context_length")),
        rope_theta=float(g.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_epsilon=float(g.need(f"{arch}.attention.layer_norm_rms_epsilon")),
        add_qkv_bias=bias,
        tie_word_embeddings="output.weight" not in names,
        head_dim=head_dim,
    )
    ids = {
        name: g.token_id(f"tokenizer.ggml.{key}", vocab)
        for name, key in (
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("unk", "unknown_token_id"),
            ("pad", "padding_token_id"),
        )
    }
    config = spec.to_hf_config()
    config.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    tok = {
        "model": tok_model,
        "pre": g.get("tokenizer.ggml.pre"),
        "tokens": tokens,
        "token_type": g.need("tokenizer.ggml.token_type"),
        "scores": g.need("tokenizer.ggml.scores") if tok_model == "llama" else None,
        "merges": g.need("tokenizer.ggml.merges") if tok_model == "gpt2" else None,
        "ids": ids,
        "add_bos": bool(g.get("tokenizer.ggml.add_bos_token", True)),
        "add_eos": bool(g.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": g.get("tokenizer.chat_template"),
    }
    return config, tok


def _hf_tensors(g: _Gguf, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    n_layers = config["num_hidden_layers"]
    heads = dict(zip(PERMUTED, (config["num_attention_heads"], config["num_key_value_heads"])))
    permuted = config["architectures"][0] == GGUF_ARCHITECTURES["llama"]
    for t in g.reader.tensors:
        parts = t.name.split(".", 2)
        if t.name in GLOBAL_NAMES:
            yield GLOBAL_NAMES[t.name], _tensor(g, t)
        elif parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers and parts[2] in LAYER_NAMES:
            w = _tensor(g, t)
            if permuted and parts[2] in heads:
                w = unpermute_qk(w, heads[parts[2]])
            yield f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}", w
        else:
            raise ValueError(f"{g.path}: unexpected GGUF tensor {t.name!r} for a {config['architectures'][0]} model")


def _write_tokenizer(tok: dict[str, Any], out_dir: Path) -> None:
    # transformers: 1-2 s to import; only tokenizers and HF models need it
    from transformers import LlamaTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer

    tokens, ids = tok["tokens"], tok["ids"]
    tokenizer_dict = {"tokenizer_type": tok["model"], "tokens": tokens, "token_type": tok["token_type"]}
    for key, value in (("scores", tok["scores"]), ("merges", tok["merges"]), ("pre_tokenizer_type", tok["pre"])):
        if value is not None:
            tokenizer_dict[key] = value
    tokenizer_dict.update({f"{k}_token_id": v for k, v in ids.items() if v is not None})
    backend, _ = convert_gguf_tokenizer("llama", tokenizer_dict)
    names = {f"{k}_token": (tokens[v] if v is not None else None) for k, v in ids.items()}
    extra = {"chat_template": tok["chat_template"]} if tok["chat_template"] else {}
    tokenizer: PreTrainedTokenizerBase
    if tok["model"] == "llama":
        tokenizer = LlamaTokenizer(
            tokenizer_object=backend, add_bos_token=tok["add_bos"], add_eos_token=tok["add_eos"], **names, **extra
        )
    else:  # byte-level BPE: no prefix space, BOS only where the file asks for it
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **names, **extra)
    tokenizer.save_pretrained(out_dir)


def gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a llama, qwen2 or qwen3 GGUF file into an HF model directory (atomically written).

    Args:
        gguf_path: the ``.gguf`` file (F32, F16, BF16 or Q8_0 tensors; Q8_0 is dequantized:
            32-value blocks, each an f16 scale times int8 values, ggml ``dequantize_row_q8_0``).
        out_dir: destination; gets config.json, model.safetensors (float32),
            tokenizer files and generation_config.json.

    Returns:
        ``Path(out_dir)``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: naming the file and the metadata key or tensor: another architecture
            or tokenizer model, rotary scaling, partial rotary, quantized tensor types,
            unexpected or missing tensors, token ids outside the vocabulary.
    """
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    g = _Gguf(path)
    config, tok = _read_config(g)
    spec, fam = family(config)
    # disable=None: the bar is drawn on a terminal only, no log lines
    tensors = dict(
        tqdm(_hf_tensors(g, config), total=len(g.reader.tensors), desc="import GGUF", unit="tensor", disable=None)
    )
    expected = fam.hf_shapes(spec)
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"{path}: GGUF tensor for {name!r} is missing")
        if tuple(tensors[name].shape) != shape:
            raise ConversionError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    with tempfile.TemporaryDirectory() as tok_dir:
        _write_tokenizer(tok, Path(tok_dir))
        return write_hf_safetensors(out_dir, config, tensors.items(), tok_dir, generation_config=gen)


def read_gguf_metadata(gguf_path: str | Path, tokenizer_dir: str | Path | None = None) -> dict[str, Any]:
    """The HF ``config.json`` dict of a llama, qwen2 or qwen3 GGUF file, from its metadata alone: no tensor
    is read (``posttrain validate`` checks a model this way without importing it).

    Args:
        gguf_path: the ``.gguf`` file.
        tokenizer_dir: if given, the tokenizer :func:`gguf_to_hf` would write is saved here.

    Raises:
        FileNotFoundError: no such file.
        ValueError: as :func:`gguf_to_hf` for the metadata (naming the file and key).
    """
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    config, tok = _read_config(_Gguf(path))
    if tokenizer_dir is not None:
        _write_tokenizer(tok, Path(tokenizer_dir))
    return config
