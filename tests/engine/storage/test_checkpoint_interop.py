"""Our torch_dist model directories load with megatron-core alone.

The real stories260K is converted by the convert stage's code path and saved; the reader
below then uses only megatron-core (``TransformerConfig``, its local layer spec,
``GPTModel`` and ``dist_checkpointing.load``) plus the CPU platform shim, following
Megatron-LM's layout rules (tracker file -> ``iter_XXXXXXX``/``release``). Its logits must
match HF transformers on the original GGUF weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from conversion.gguf import gguf_to_hf
from conversion.hf_source import load_hf_source
from conversion.registry import hf_to_megatron
from conversion.spec import GPTSpec
from engine.models.megatron import build_gpt_model
from engine.models.platform import init_model_parallel
from engine.storage.model_dir import save_model_dir

TOL = 1e-4  # megatron's strided SiLU rounds a little differently from HF's (see silu_contiguous)


def _megatron_core_only_load(megatron_dir: Path, vocab_size: int):
    """A GPTModel built and loaded with megatron-core's own API only."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tracker = (megatron_dir / "latest_checkpointed_iteration.txt").read_text().strip()
    ckpt = megatron_dir / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    hf = json.loads((ckpt / "hf_config.json").read_text())
    config = TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        kv_channels=hf["hidden_size"] // hf["num_attention_heads"],
        normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab_size,
        max_sequence_length=hf["max_position_embeddings"],
        share_embeddings_and_output_weights=hf.get("tie_word_embeddings", False),
        position_embedding_type="rope",
        rotary_base=hf["rope_parameters"]["rope_theta"],
    )
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    model.load_state_dict(state["model"], strict=False)  # _extra_state entries are TE bookkeeping
    return model.eval(), ckpt


def test_stories260k_checkpoint_loads_with_dist_checkpointing_alone(fixtures_dir, tmp_path):
    gguf = fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf"
    source = load_hf_source(gguf, cache_dir=tmp_path / "cache")
    init_model_parallel()
    spec = GPTSpec.from_hf_config(source.config).with_vocab_padding(128)
    ours = build_gpt_model(spec)
    ours.load_state_dict(hf_to_megatron(source.config, source.state, spec.padded_vocab_size), strict=True)
    out = save_model_dir(tmp_path / "model", ours, source.config, source.tokenizer_dir)

    model, ckpt = _megatron_core_only_load(out / "megatron", spec.megatron_vocab_size)
    assert ckpt.name == "release" and sorted(p.name for p in (out / "megatron").iterdir()) == [
        "latest_checkpointed_iteration.txt",
        "release",
    ]
    loaded = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    saved = {k: v for k, v in ours.state_dict().items() if not k.endswith("_extra_state")}
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)

    hf = LlamaForCausalLM.from_pretrained(gguf_to_hf(gguf, tmp_path / "hf")).eval()
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        logits = model(ids, pos, attention_mask=None).float()[..., :512]
    err = (logits - ref).abs().max().item()
    print(f"stories260K via dist_checkpointing only: max |logit diff| vs transformers = {err:.2e}")
    assert err < TOL
