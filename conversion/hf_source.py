"""Load an HF model source: a local directory, a hub id, or a llama GGUF file.

Weights are read with safetensors, or ``torch.load(weights_only=True)`` for
``pytorch_model*.bin`` (never a full unpickle).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from conversion.export import TOKENIZER_FILES, has_tokenizer_files, missing_vocabulary
from conversion.gguf import gguf_to_hf

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", *TOKENIZER_FILES]


class HFSource(NamedTuple):
    """A loaded model: HF config dict, HF-named fp tensors, and the tokenizer directory."""

    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    tokenizer_dir: Path


def read_config_json(path: Path, what: str = "not an HF model directory") -> dict[str, Any]:
    """An HF ``config.json`` as a dict.

    Raises:
        FileNotFoundError: ``path`` is missing (the message adds ``what``).
        ValueError: naming the file and the line and column, if it is not a JSON object.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing ({what})")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def _load_dir(model_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = read_config_json(model_dir / "config.json")
    state: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        files = sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors or pytorch_model*.bin weights")
    # one bar over the weight bytes; disable=None: drawn on a terminal only, no log lines
    with tqdm(
        total=sum(f.stat().st_size for f in files), desc="read weights", unit="B", unit_scale=True, disable=None
    ) as progress:
        for f in files:
            try:
                part = (
                    load_file(str(f))
                    if f.suffix == ".safetensors"
                    else torch.load(f, map_location="cpu", weights_only=True)
                )
            except Exception as e:  # safetensors' and torch's errors do not name the file
                raise ValueError(f"{f}: cannot read the weights (corrupt or truncated file?): {e}") from e
            repeated = sorted(part.keys() & state.keys())
            if repeated:
                raise ValueError(f"{f}: tensor {repeated[0]!r} is also in another weights file of {model_dir}")
            state.update(part)
            progress.update(f.stat().st_size)
    return config, state


def _gguf_cache_dir(path: Path, cache_root: Path) -> Path:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return cache_root / f"{path.stem}-{h.hexdigest()[:16]}"


def load_hf_source(
    source: str | Path,
    revision: str | None = None,
    tokenizer: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> HFSource:
    """Load a model from a directory, a ``.gguf`` file or an HF hub id.

    Args:
        source: HF model directory (config.json + weights), a llama ``.gguf`` file, or a
            hub id ``org/name`` (``huggingface_hub.snapshot_download`` of config, SafeTensors
            weights and tokenizer files only).
        revision: hub revision (hub ids only).
        tokenizer: tokenizer directory, if not the model's own directory.
        cache_dir: where GGUF imports and hub downloads are kept (default: the system
            temporary directory / ``posttrain-models``). A GGUF import is keyed by the
            file's sha256, so re-loading the same file reuses it.

    Returns:
        :class:`HFSource` ``(config, state, tokenizer_dir)``.

    Raises:
        FileNotFoundError: no such path (and not a hub id), no config.json, no weights, no
            tokenizer files in the tokenizer directory, or none that hold its vocabulary
            (the message names the files found and the files needed).
        ValueError: from the GGUF import (naming the key or tensor).
    """
    cache_root = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "posttrain-models"
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        model_dir = _gguf_cache_dir(path, cache_root)
        if not (model_dir / "config.json").is_file():
            try:
                gguf_to_hf(path, model_dir)
            except (ValueError, KeyError, OSError, EOFError) as e:
                if str(path) in str(e):
                    raise
                raise ValueError(f"{path}: cannot import this GGUF file (not GGUF, corrupt or truncated?): {e}") from e
    elif path.is_dir():
        model_dir = path
    elif path.exists():
        raise ValueError(f"{path}: model source must be a directory or a .gguf file")
    elif _HUB_ID.match(str(source)):
        # huggingface_hub: its client takes ~0.4 s to import; only Hub calls need it
        from huggingface_hub import snapshot_download

        model_dir = Path(
            snapshot_download(
                str(source), revision=revision, cache_dir=str(cache_root / "hub"), allow_patterns=_HUB_PATTERNS
            )
        )
    else:
        raise FileNotFoundError(f"{source}: no such model directory or .gguf file, and not a hub id (org/name)")
    config, state = _load_dir(model_dir)
    tok_dir = Path(tokenizer) if tokenizer else model_dir
    if not has_tokenizer_files(tok_dir):
        raise FileNotFoundError(f"{tok_dir}: no tokenizer files (expected some of {', '.join(TOKENIZER_FILES)})")
    why = missing_vocabulary(tok_dir)
    if why is not None:
        raise FileNotFoundError(f"{'model.tokenizer' if tokenizer else 'model.source'}: {why}")
    return HFSource(config, state, tok_dir)


def check_tokenizer_fits(source: HFSource) -> None:
    """Refuse a tokenizer with more tokens than the model has embedding rows.

    Its ids past ``vocab_size`` would crash training with an index error far from the
    cause (the convert stage calls this before writing anything).

    Raises:
        ValueError: naming the tokenizer directory, both sizes and ``model.tokenizer``.
    """
    # transformers: 1-2 s to import; only tokenizers and HF models need it
    from transformers import AutoTokenizer

    vocab = source.config.get("vocab_size")
    if not isinstance(vocab, int):  # nothing to compare with: GPTSpec.from_hf_config names the missing key
        return
    tokens = len(AutoTokenizer.from_pretrained(str(source.tokenizer_dir)))
    if tokens > vocab:
        raise ValueError(
            f"{source.tokenizer_dir}: the tokenizer has {tokens} tokens but the model's config.json has "
            f"vocab_size={vocab}: model.tokenizer does not belong to this model"
        )
