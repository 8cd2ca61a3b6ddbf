"""convert: HF model (directory, hub id or GGUF file) -> Megatron torch_dist model directory.

Artifact: ``model/`` with ``megatron/`` (Megatron-LM layout, torch_dist) and ``hf/``
(config, tokenizer, generation config) so later stages can map back to HF names.
"""

from __future__ import annotations

from pathlib import Path

from config.moe import MoERouterConfig
from config.schema import PipelineConfig
from tasks.runner import StageContext, stage_task
from tasks.spec import StageSpec


def _raw(cfg: PipelineConfig) -> dict[str, str]:
    # A local directory or GGUF file is hashed by content; a hub id is pinned by revision.
    raw = {"model": cfg.model.source} if Path(cfg.model.source).exists() else {}
    if cfg.model.tokenizer:
        raw["tokenizer"] = cfg.model.tokenizer
    return raw


SPEC = StageSpec(
    name="convert",
    inputs=lambda cfg: (),
    # model.moe enters the fingerprint only when set, so configs without it keep their artifacts
    config=lambda cfg: {
        "model": cfg.model.model_dump(exclude={"moe"} if cfg.model.moe == MoERouterConfig() else set()),
        "convert": cfg.convert.model_dump(),
    },
    raw_inputs=_raw,
    summary=("model/parameters",),
)


@stage_task(SPEC)
def convert(ctx: StageContext) -> dict:
    """Load the HF weights, map them to Megatron names, save as torch_dist."""
    # imported here, not at module level: a cached run must not pay for torch's import
    from conversion.hf_source import check_tokenizer_fits, load_hf_source
    from conversion.registry import hf_to_megatron
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model
    from engine.models.platform import init_model_parallel
    from engine.storage.model_dir import save_model_dir

    m = ctx.cfg.model
    source = load_hf_source(m.source, revision=m.revision, tokenizer=m.tokenizer)
    check_tokenizer_fits(source)
    init_model_parallel()
    # Megatron-LM pads to make_vocab_size_divisible_by × TP; training here runs at TP=1.
    spec = GPTSpec.from_hf_config(source.config).with_vocab_padding(ctx.cfg.convert.make_vocab_size_divisible_by)
    model = build_gpt_model(spec, router=m.moe)  # the router settings are recorded in the model directory
    model.load_state_dict(hf_to_megatron(source.config, source.state, spec.padded_vocab_size), strict=True)
    vocab = int(source.config["vocab_size"])
    bad = [t for t in m.eos_token_ids or () if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"model.eos_token_ids: {bad} outside the vocabulary of {m.source} (0..{vocab - 1})")
    overrides = {"eos_token_id": list(m.eos_token_ids)} if m.eos_token_ids else None
    stop_ids, record = _turn_end(source.tokenizer_dir, m.end_of_turn, ctx.logger)
    save_model_dir(
        ctx.workdir / "model",
        model,
        source.config,
        source.tokenizer_dir,
        generation_overrides=overrides,
        stop_token_ids=stop_ids,
        tokenizer_config_updates=record,
    )
    return {"model/parameters": sum(p.numel() for p in model.parameters())}


def _turn_end(tokenizer_dir, override: str | None, log) -> tuple[list[int], dict | None]:
    """The chat template's turn end (``data.chat_template.end_of_turn``): its stop id, added to the EOS
    ids generation stops on, and the marker, recorded in the model directory's
    tokenizer_config.json so every later stage (and the export) uses the same one."""
    # transformers and the chat-template checks: not paid by a cached run
    from transformers import AutoTokenizer

    from data.chat_template import RECORDED_KEY, ChatTemplateError, end_of_turn, turn_end_token_id

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if getattr(tokenizer, "chat_template", None) is None:
        if override is not None:
            raise ValueError(
                f"model.end_of_turn: {tokenizer_dir} has no chat template, so there is no turn to end; remove it"
            )
        return [], None
    try:
        marker = end_of_turn(tokenizer, override)
        stop = turn_end_token_id(tokenizer, override)
    except ChatTemplateError as e:
        raise ValueError(f"model.end_of_turn: {e}") from e
    log.info("convert: an assistant turn ends with %r (stop id %s)", marker, stop)
    if stop is None:
        log.warning(
            "the turn end %r is not a single special token (nor ends with one): generation stops "
            "only at the EOS ids (stop strings are not available with token-in/token-out rollout)",
            marker,
        )
    return ([] if stop is None else [stop]), {RECORDED_KEY: marker}
