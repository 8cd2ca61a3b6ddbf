"""The on-disk model directory every model artifact uses (base, SFT, reward model, policy).

Layout::

    <model_dir>/
      megatron/            torch_dist checkpoint in Megatron-LM layout (engine.storage.torch_dist)
      hf/                  config.json (HF architecture), generation_config.json and the
                           tokenizer files; no weights
      heads.safetensors    optional extra heads (e.g. reward_head.weight / .bias)
      megatron_spec.json   what megatron's model has beyond hf/config.json: today the
                           padded vocabulary size, when the vocabulary is padded
      moe_router.json      an MoE model's router training settings (model.moe,
                           config.moe.MoERouterConfig), when they are not the defaults

``hf/`` alone is enough for ``AutoTokenizer.from_pretrained`` and for building the HF
architecture; export to SafeTensors and rollout weight sync map ``megatron/`` onto it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from config.moe import MoERouterConfig
from conversion.export import replace_dir_atomically, save_safetensors
from conversion.hf_source import read_config_json
from conversion.spec import GPTSpec
from engine.distributed.collectives import barrier, global_rank
from engine.models.megatron import build_gpt_model
from engine.storage.torch_dist import load_model_checkpoint, save_model_checkpoint, shared_temporary_dir

if TYPE_CHECKING:
    from engine.models.megatron import CoreAttention

MEGATRON_SUBDIR = "megatron"


MEGATRON_SPEC_FILE = "megatron_spec.json"


MOE_ROUTER_FILE = "moe_router.json"


HF_SUBDIR = "hf"


HEADS_FILE = "heads.safetensors"


# Files that make up a transformers tokenizer (slow or fast) plus its chat template.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass
class LoadedModel:
    """A model directory brought into memory.

    Attributes:
        spec: the architecture.
        hf_config: ``hf/config.json`` as a dict.
        model: megatron-core ``GPTModel`` (train mode, CPU, fp32 unless
            :func:`load_model_dir` was given another ``dtype``) with the saved weights.
        tokenizer_dir: the ``hf/`` directory (tokenizer files live there).
        heads: extra head tensors from ``heads.safetensors`` (empty if there is none).
        path: the model directory.
    """

    spec: GPTSpec
    hf_config: dict[str, Any]
    model: torch.nn.Module
    tokenizer_dir: Path
    heads: dict[str, torch.Tensor] = field(default_factory=dict)
    path: Path | None = None


def _generation_config(hf_config: dict[str, Any], tokenizer_dir: Path) -> dict[str, Any]:
    # transformers: 1-2 s to import; only tokenizers and HF models need it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    gen: dict[str, Any] = {}
    # The tokenizer's EOS (Qwen instruct: <|im_end|>), else the model config's ids; the convert
    # stage adds the chat template's own turn end (stop_token_ids) when it is another token.
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tok, key, None)
        if value is None:
            value = hf_config.get(key)
        if value is not None:
            gen[key] = value
    return gen


def save_model_dir(
    out_dir: str | Path,
    model: torch.nn.Module,
    hf_config: dict[str, Any],
    tokenizer_dir: str | Path,
    iteration: int | None = None,
    heads: dict[str, torch.Tensor] | None = None,
    generation_overrides: dict[str, Any] | None = None,
    stop_token_ids: Sequence[int] = (),
    tokenizer_config_updates: dict[str, Any] | None = None,
) -> Path:
    """Write a model directory atomically (temporary sibling, then rename).

    An existing ``out_dir`` is replaced as a whole, so readers see either the old or the
    new directory, never a mix.

    Args:
        out_dir: directory to create.
        model: megatron-core ``GPTModel`` whose weights are saved (torch_dist).
        hf_config: HF ``config.json`` dict describing ``model``'s architecture.
        tokenizer_dir: directory holding the tokenizer files (e.g. another model dir's
            ``hf/``); its ``generation_config.json`` is copied too when present.
        iteration: training iteration recorded by the checkpoint (None: a release checkpoint).
        heads: extra tensors (name -> tensor), stored in ``heads.safetensors``.
        generation_overrides: keys replaced in ``generation_config.json`` (e.g.
            ``{"eos_token_id": [2, 1]}``); later stages copy the file on, so it holds for good.
        stop_token_ids: ids added (after the overrides) to ``generation_config.json``'s
            ``eos_token_id`` list where missing, e.g. the chat template's turn end
            (``data.chat_template.turn_end_token_id``), so every rollout engine and the export stop on them.
        tokenizer_config_updates: keys merged into the copied ``tokenizer_config.json``
            (created if absent), e.g. the recorded turn end (``data.chat_template.RECORDED_KEY``).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: ``hf_config`` is not a supported architecture or does not match
            ``model.gpt_spec``.
        FileNotFoundError: ``tokenizer_dir`` holds none of :data:`TOKENIZER_FILES`.
    """
    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    spec = GPTSpec.from_hf_config(hf_config)
    model_spec = getattr(model, "gpt_spec", None)
    if model_spec is not None:
        if model_spec.model_copy(update={"padded_vocab_size": None}) != spec:
            raise ValueError(f"hf_config describes {spec!r} but the model was built as {model_spec!r}")
        spec = model_spec
    tok_files = [tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    if not tok_files:
        raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks (data/tensor parallelism): rank 0 writes everything but the torch_dist
    # shards, which every rank writes (save_model_checkpoint), and publishes the directory.
    lead = global_rank() == 0
    # A plain mkdir (not mkdtemp's 0o700): the published directory gets the user's umask.
    tmp = shared_temporary_dir(out_dir.parent, f".{out_dir.name}.tmp-")
    if not lead:
        save_model_checkpoint(model, tmp / MEGATRON_SUBDIR, iteration, hf_config=hf_config)
        barrier()  # rank 0 publishes
        return out_dir
    try:
        hf = tmp / HF_SUBDIR
        hf.mkdir()
        for f in tok_files:
            shutil.copy2(f, hf / f.name)
        if tokenizer_config_updates:
            tc_path = hf / "tokenizer_config.json"
            tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
            tc_path.write_text(json.dumps({**tc, **tokenizer_config_updates}, indent=2, ensure_ascii=False) + "\n")
        (hf / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        if spec.padded_vocab_size is not None:
            (tmp / MEGATRON_SPEC_FILE).write_text(json.dumps({"padded_vocab_size": spec.padded_vocab_size}) + "\n")
        router = getattr(model, "moe_router", None)
        if router is not None and router != MoERouterConfig():
            (tmp / MOE_ROUTER_FILE).write_text(json.dumps(router.model_dump(), sort_keys=True) + "\n")
        if (tokenizer_dir / "generation_config.json").is_file():
            gen = json.loads((tokenizer_dir / "generation_config.json").read_text())
        else:
            gen = _generation_config(hf_config, hf)
        gen = {**gen, **(generation_overrides or {})}
        eos = gen.get("eos_token_id")
        eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
        extra = [int(t) for t in dict.fromkeys(stop_token_ids) if int(t) not in eos]
        if extra:  # ids already there leave the file as it was
            gen["eos_token_id"] = eos + extra
        (hf / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        save_model_checkpoint(model, tmp / MEGATRON_SUBDIR, iteration, hf_config=hf_config)
        if heads:
            save_safetensors({k: v.detach().to("cpu").contiguous() for k, v in heads.items()}, tmp / HEADS_FILE)
        replace_dir_atomically(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    return out_dir


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """``<model_dir>/hf/config.json`` as a dict.

    Raises:
        FileNotFoundError: naming the missing file.
        ValueError: naming the file, if it is not a JSON object.
    """
    return read_config_json(Path(model_dir) / HF_SUBDIR / "config.json", f"{model_dir} is not a model directory")


def load_model_dir(
    model_dir: str | Path, seed: int = 0, core_attention: CoreAttention = "sdpa", dtype: torch.dtype = torch.float32
) -> LoadedModel:
    """Build the megatron-core model of a model directory and load its weights.

    Args:
        model_dir: a directory written by :func:`save_model_dir` (or the convert stage).
        seed: initialisation seed of the model before the checkpoint overwrites it
            (only matters for tensors a checkpoint does not hold).
        core_attention: "sdpa" (faster on CPU) or "local"; same results
            (see ``engine.models.megatron.build_gpt_model``).
        dtype: the model's floating dtype. The checkpoint's fp32 weights are loaded first and
            then cast (``model.to(dtype)``, round-to-nearest-even): ``torch.bfloat16`` for an
            inference-only model under bf16. Keep fp32 for a model that will train: the fp32
            masters of mixed precision are made from the fp32 weights
            (``engine.training.optimizer_step.build_model_optimizer``). ``heads`` stay as stored.

    Raises:
        FileNotFoundError: ``hf/config.json`` or ``megatron/`` is missing (names the path).
        ValueError: the config is not a supported architecture (names the key).
    """
    model_dir = Path(model_dir)
    hf_config = read_hf_config(model_dir)
    ckpt = model_dir / MEGATRON_SUBDIR
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{ckpt}: missing torch_dist checkpoint directory")
    spec = GPTSpec.from_hf_config(hf_config)
    extra = model_dir / MEGATRON_SPEC_FILE
    if extra.is_file():
        try:
            padded = json.loads(extra.read_text())["padded_vocab_size"]
            spec = spec.model_copy(update={"padded_vocab_size": padded})
            GPTSpec.model_validate(spec.model_dump())
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f'{extra}: expected {{"padded_vocab_size": <int >= vocab_size>}} ({e})') from e
    model = build_gpt_model(spec, seed=seed, core_attention=core_attention, router=read_moe_router(model_dir))
    load_model_checkpoint(model, ckpt)
    if dtype != torch.float32:
        model.to(dtype)
    heads_path = model_dir / HEADS_FILE
    heads = load_file(str(heads_path)) if heads_path.is_file() else {}
    return LoadedModel(spec, hf_config, model, model_dir / HF_SUBDIR, heads, model_dir)


def read_moe_router(model_dir: str | Path) -> MoERouterConfig | None:
    """The router settings recorded in ``<model_dir>/moe_router.json`` (None when absent:
    the defaults, no router losses).

    Raises:
        ValueError: naming the file and the bad key, when it is not a valid ``model.moe``.
    """
    path = Path(model_dir) / MOE_ROUTER_FILE
    if not path.is_file():
        return None
    try:
        return MoERouterConfig.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a valid model.moe section ({e})") from e


def load_tokenizer(model_dir: str | Path):
    """``transformers.AutoTokenizer`` from ``<model_dir>/hf``.

    Raises:
        FileNotFoundError: naming ``<model_dir>/hf`` when it does not exist.
    """
    hf = Path(model_dir) / HF_SUBDIR
    if not hf.is_dir():
        raise FileNotFoundError(f"{hf}: missing; {model_dir} is not a model directory")
    # transformers: 1-2 s to import; only tokenizers and HF models need it
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf))
