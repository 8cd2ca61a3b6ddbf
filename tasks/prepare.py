"""prepare (example configs only): write the example's own inputs.

``kind: addition`` (the quickstart) builds a tokenizer, a random-init base model and the
addition datasets; ``kind: code`` (configs/quickstart-code.yaml) the same for the coding task
of ``data.code_task``; ``kind: stories`` (configs/tinystories.yaml) writes story-opening prompts
for a pretrained model that ``model.source`` names.

Not an artifact stage: it writes plain files to ``prepare.output_dir`` that the config's
``data.*.path`` and ``model.source`` point at, exactly as a user's own files would be.
The directory is replaced atomically and skipped when its stamp matches the config.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from prefect import task
from prefect.logging import get_run_logger

from config.prepare import AdditionPrepareConfig, CodePrepareConfig, StoriesPrepareConfig, TinyModelPrepareConfig
from config.schema import PipelineConfig
from tasks.fingerprint import code_version, fingerprint

STAMP = ".prepare.json"


def _section(cfg: PipelineConfig) -> AdditionPrepareConfig | CodePrepareConfig | StoriesPrepareConfig:
    """``cfg.prepare``; ValueError when the config has no prepare section."""
    if cfg.prepare is None:
        raise ValueError(
            "prepare: the config has no prepare section; add one (prepare.kind: addition, code or stories)"
        )
    return cfg.prepare


def prepare_fingerprint(cfg: PipelineConfig) -> str:
    return fingerprint("prepare", {}, _fingerprint_config(cfg), code_version("tasks.prepare"))


def _fingerprint_config(cfg: PipelineConfig) -> dict:
    """The config part of :func:`prepare_fingerprint`: the prepare section and the seed. An unset
    ``prepare.moe`` (the dense model) is left out, so dense configs hash as they did before it."""
    dump = _section(cfg).model_dump()
    if dump.get("moe", 0) is None:
        del dump["moe"]
    return {"prepare": dump, "seed": cfg.run.seed}


def _qwen2_config(p, vocab_size: int, tokenizer) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "max_position_embeddings": p.max_position_embeddings,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


def _qwen3_moe_config(p, vocab_size: int, tokenizer) -> dict:
    """The Qwen3-MoE variant of :func:`_qwen2_config` for ``prepare.moe``: every layer's MLP a
    routed MoE block (``decoder_sparse_step`` 1, no ``mlp_only_layers``) of ``num_experts`` SwiGLU
    experts of width ``moe_intermediate_size``, top-k renormalised (``norm_topk_prob``, as the
    released Qwen3-MoE models); per-head q/k RMSNorm and no attention biases (Qwen3's attention).
    These are the keys ``conversion.moe_config.moe_fields_from_hf`` reads."""
    moe = p.moe
    out = _qwen2_config(p, vocab_size, tokenizer)
    out.update(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "head_dim": p.hidden_size // p.num_attention_heads,
            "attention_bias": False,
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.num_experts_per_tok,
            "moe_intermediate_size": moe.moe_intermediate_size,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": False,
        }
    )
    return out


def _strings(jsonl: Path) -> list[str]:
    """Every string value of every record (the text the tokenizer will see, minus JSON syntax)."""
    out: list[str] = []

    def walk(value) -> None:
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for line in jsonl.read_text(encoding="utf-8").splitlines():
        walk(json.loads(line))
    return out


def is_prepared(cfg: PipelineConfig) -> bool:
    """True when ``prepare.output_dir`` holds the output of this exact prepare config and code."""
    stamp = Path(_section(cfg).output_dir) / STAMP
    return stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == prepare_fingerprint(cfg)


def _tokenizer_and_model(cfg: PipelineConfig, tmp: Path, files: dict[str, Path]) -> None:
    """A BPE chat tokenizer trained on every string of ``files``, and a random Qwen2 model with it
    (Qwen3-MoE with ``prepare.moe``)."""
    # imported here, not at module level: a cached run must not pay for torch's import
    # transformers is heavy: only when a tokenizer is trained
    from transformers import AutoTokenizer

    from conversion.random_init import init_random_hf_model
    from data.tokenizer_train import train_chat_tokenizer

    p = cfg.prepare
    assert isinstance(p, TinyModelPrepareConfig)  # the kinds that train a tokenizer and a model
    texts = [text for path in files.values() for text in _strings(Path(path))]
    tok_dir = train_chat_tokenizer(texts, tmp / "tokenizer", vocab_size=p.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    moe = getattr(p, "moe", None)  # the addition kind's; the code kind has no MoE variant
    hf_config = (_qwen2_config if moe is None else _qwen3_moe_config)(p, len(tokenizer), tokenizer)
    init_random_hf_model(tmp / "base_model", hf_config, seed=cfg.run.seed, tokenizer_dir=tok_dir)


def _write_addition(cfg: PipelineConfig, tmp: Path) -> None:
    # each generator only when its dataset kind is asked for (they pull in tokenizers and torch)
    from data.addition import make_addition_datasets

    p = cfg.prepare
    assert isinstance(p, AdditionPrepareConfig)  # dispatched on prepare.kind
    files = make_addition_datasets(
        tmp, num_sft=p.num_sft, num_preference=p.num_preference, num_rl=p.num_rl, num_eval=p.num_eval, seed=cfg.run.seed
    )
    _tokenizer_and_model(cfg, tmp, files)


def _write_code(cfg: PipelineConfig, tmp: Path) -> None:
    # each generator only when its dataset kind is asked for (they pull in tokenizers and torch)
    from data.code_task import make_code_datasets

    p = cfg.prepare
    assert isinstance(p, CodePrepareConfig)  # dispatched on prepare.kind
    files = make_code_datasets(tmp, num_sft=p.num_sft, num_rl=p.num_rl, num_eval=p.num_eval, seed=cfg.run.seed)
    _tokenizer_and_model(cfg, tmp, files)


def _write_stories(cfg: PipelineConfig, tmp: Path) -> None:
    # each generator only when its dataset kind is asked for (they pull in tokenizers and torch)
    from data.stories import make_story_datasets

    p = cfg.prepare
    assert isinstance(p, StoriesPrepareConfig)  # dispatched on prepare.kind
    make_story_datasets(tmp, num_rl=p.num_rl, num_eval=p.num_eval, seed=cfg.run.seed)


@task(
    name="prepare",
    cache_key_fn=lambda ctx, params: f"prepare-{prepare_fingerprint(params['cfg'])}",
    persist_result=True,
)
def prepare(cfg: PipelineConfig) -> str:
    """Write the example's inputs under ``prepare.output_dir``; returns that path."""
    p = _section(cfg)
    out = Path(p.output_dir)
    fp = prepare_fingerprint(cfg)
    if is_prepared(cfg):
        get_run_logger().info("prepare: %s is up to date", out)
        return str(out)
    if out.is_dir() and any(out.iterdir()) and not (out / STAMP).is_file():
        raise ValueError(
            f"prepare.output_dir: {out} holds files prepare did not write; it would replace the "
            "whole directory, so point prepare.output_dir at a new or prepare-made directory"
        )
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        {"addition": _write_addition, "code": _write_code, "stories": _write_stories}[p.kind](cfg, tmp)
        (tmp / STAMP).write_text(json.dumps({"fingerprint": fp}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    get_run_logger().info("prepare: wrote %s", out)
    return str(out)
