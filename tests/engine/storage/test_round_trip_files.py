"""HF -> Megatron model directory (torch_dist, vocabulary padded) -> HF, file by file, for
the real stories260K: every tensor's bytes (sha256), the tokenizer files and the config."""

from __future__ import annotations

import hashlib
import json

from safetensors import safe_open

from conversion.gguf import gguf_to_hf
from conversion.hf_source import load_hf_source
from conversion.registry import hf_to_megatron
from conversion.spec import GPTSpec
from engine.models.megatron import build_gpt_model
from engine.models.platform import init_model_parallel
from engine.storage.hf_io import export_model_dir
from engine.storage.model_dir import save_model_dir


def _tensor_digests(hf_dir) -> dict[str, str]:
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        return {k: hashlib.sha256(f.get_tensor(k).contiguous().numpy().tobytes()).hexdigest() for k in f.keys()}


def test_stories260k_round_trip_is_byte_identical(fixtures_dir, tmp_path):
    original = gguf_to_hf(fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf", tmp_path / "hf")
    source = load_hf_source(original)
    init_model_parallel()
    spec = GPTSpec.from_hf_config(source.config).with_vocab_padding(384)  # 512 -> 768 rows in megatron
    model = build_gpt_model(spec)
    model.load_state_dict(hf_to_megatron(source.config, source.state, spec.padded_vocab_size), strict=True)
    assert model.embedding.word_embeddings.weight.shape[0] == 768
    model_dir = save_model_dir(tmp_path / "model", model, source.config, source.tokenizer_dir)
    back = export_model_dir(model_dir, tmp_path / "back")

    before, after = _tensor_digests(original), _tensor_digests(back)
    assert after.keys() == before.keys() and after == before  # every tensor, bit for bit
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (back / name).read_bytes() == (original / name).read_bytes(), name
    cfg_before, cfg_after = (json.loads((d / "config.json").read_text()) for d in (original, back))
    assert GPTSpec.from_hf_config(cfg_after) == GPTSpec.from_hf_config(cfg_before)
    assert {k: v for k, v in cfg_after.items() if k != "dtype"} == {k: v for k, v in cfg_before.items() if k != "dtype"}
    assert json.loads((back / "generation_config.json").read_text()) == json.loads(
        (original / "generation_config.json").read_text()
    )
