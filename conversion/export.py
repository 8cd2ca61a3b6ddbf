"""Write an HF model directory (config.json, model.safetensors, tokenizer, generation config).

The directory is assembled in a temporary sibling and renamed into place, so a reader
never sees a half-written model.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# Files transformers' tokenizers read; whichever exist in the tokenizer directory are copied.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# What holds the vocabulary itself, one of which a tokenizer directory needs (the rest of
# TOKENIZER_FILES only configure it): a fast tokenizer, a byte-level BPE pair, SentencePiece.
VOCABULARY_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))
GPT2_ORIGINAL_FILES = ("encoder.json", "vocab.bpe")  # OpenAI's release: vocab.json and merges.txt by other names
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def generation_config_from(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The token ids of ``hf_config`` that ``generation_config.json`` carries (bos/eos/pad)."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: hf_config[k] for k in keys if hf_config.get(k) is not None}


def has_tokenizer_files(tokenizer_dir: str | Path) -> bool:
    """Whether ``tokenizer_dir`` holds any of :data:`TOKENIZER_FILES` or GPT-2's original files."""
    return any((Path(tokenizer_dir) / n).is_file() for n in (*TOKENIZER_FILES, *GPT2_ORIGINAL_FILES))


def missing_vocabulary(tokenizer_dir: str | Path) -> str | None:
    """Why ``tokenizer_dir`` cannot give a tokenizer, or None: it holds none of
    :data:`VOCABULARY_FILES` (transformers would then fail with a misleading hint to install
    sentencepiece or tiktoken). The text names the files found and the files needed, and the
    fix; GPT-2's original OpenAI files (encoder.json, vocab.bpe) are recognised."""
    src = Path(tokenizer_dir)
    if any(all((src / n).is_file() for n in group) for group in VOCABULARY_FILES):
        return None
    found = sorted(p.name for p in src.iterdir() if p.is_file()) if src.is_dir() else []
    needed = ", or ".join(" and ".join(group) for group in VOCABULARY_FILES)
    fix = (
        "encoder.json and vocab.bpe are GPT-2's original files: rename them to vocab.json and merges.txt, or "
        if all((src / n).is_file() for n in GPT2_ORIGINAL_FILES)
        else ""
    )
    return (
        f"{src} holds {', '.join(found) or 'no files'} but no tokenizer vocabulary: a tokenizer needs "
        f"{needed}; {fix}load the tokenizer with transformers and save_pretrained() it into this folder"
    )


def copy_tokenizer_files(tokenizer_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the tokenizer files of ``tokenizer_dir`` into ``out_dir``; returns their names.

    Raises:
        FileNotFoundError: ``tokenizer_dir`` holds none of :data:`TOKENIZER_FILES`.
    """
    src = Path(tokenizer_dir)
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if not names:
        raise FileNotFoundError(f"{src}: no tokenizer files (expected some of {', '.join(TOKENIZER_FILES)})")
    for n in names:
        shutil.copy2(src / n, Path(out_dir) / n)
    return names


def process_umask() -> int:
    """The process's file-mode creation mask (e.g. ``0o022``), read without changing it where
    Linux reports it (``/proc/self/status``, kernel 4.7+); elsewhere set and put back at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: Mapping[str, str] | None = None
) -> Path:
    """``safetensors.torch.save_file``, then the file's mode set to what any new file of the
    user gets (``0o666`` less :func:`process_umask`): save_file creates it ``0o600``, which
    leaves an artifact in a store a team shares readable by its writer alone.

    Raises:
        As ``save_file`` (e.g. tensors that share memory).
    """
    save_file(dict(tensors), str(path), metadata=dict(metadata) if metadata is not None else None)
    os.chmod(path, 0o666 & ~process_umask())
    return Path(path)


def grant_umask_modes(directory: str | Path) -> None:
    """Give every regular file under ``directory`` the mode any new file of the user gets
    (``0o666`` less :func:`process_umask`): libraries that write with ``0o600`` (safetensors'
    ``save_file`` inside transformers' ``save_pretrained``) would otherwise publish files only
    their writer can read. Symlinks are left alone."""
    mode = 0o666 & ~process_umask()
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def replace_dir_atomically(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` directory to ``final``, replacing an existing one."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


@contextmanager
def atomic_hf_dir(out_dir: str | Path, tokenizer_dir: str | Path | None) -> Iterator[Path]:
    """Yield a temporary sibling of ``out_dir`` to fill; on success copy the tokenizer files
    into it, give its files the umask's modes (:func:`grant_umask_modes`) and rename it over
    ``out_dir``; on any error remove it (nothing half-written)."""
    final = Path(out_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
        grant_umask_modes(tmp)
        replace_dir_atomically(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_hf_safetensors(
    out_dir: str | Path,
    hf_config: Mapping[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    tokenizer_dir: str | Path | None,
    dtype: str = "float32",
    generation_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write an HF model directory that ``AutoModelForCausalLM.from_pretrained`` loads.

    Args:
        out_dir: destination directory (replaced if it exists).
        hf_config: HF ``config.json`` dict; its ``dtype`` (what transformers >= 4.56 and vLLM
            read) and ``torch_dtype`` (what older transformers read) are set to ``dtype``, so
            ``from_pretrained`` without a dtype loads the weights as stored.
        tensors: HF-named tensors, e.g. ``conversion.megatron_to_hf(...)``; gathered into
            one ``model.safetensors`` (single shard; fine for the model sizes run here).
        tokenizer_dir: directory whose tokenizer files are copied (None: no tokenizer).
        dtype: "float32", "bfloat16" or "float16" for the stored weights (every tensor is
            cast to it; float32 -> bfloat16/float16 rounds to nearest even).
        generation_config: ``generation_config.json`` contents; default: the bos/eos/pad
            token ids of ``hf_config`` (not written if there are none).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: unknown dtype or a tensor name given twice.
        FileNotFoundError: ``tokenizer_dir`` has no tokenizer files.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    with atomic_hf_dir(out_dir, tokenizer_dir) as tmp:
        state: dict[str, torch.Tensor] = {}
        for name, t in tensors:
            if name in state:
                raise ValueError(f"tensor {name!r} given twice")
            # clone: safetensors refuses tensors sharing storage (e.g. views of one fused QKV).
            state[name] = t.detach().to(device="cpu", dtype=_DTYPES[dtype]).contiguous().clone()
        save_safetensors(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = {**dict(hf_config), "dtype": dtype, "torch_dtype": dtype}
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        gen = dict(generation_config) if generation_config is not None else generation_config_from(hf_config)
        if gen:
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True))
    return Path(out_dir)
