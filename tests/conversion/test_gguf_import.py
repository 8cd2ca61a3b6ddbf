"""GGUF (llama.cpp) import: the real stories260K, and GGUF files written here with llama.cpp's writer."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conversion.gguf import gguf_to_hf
from conversion.hf_source import load_hf_source

PROMPT = "Once upon a time, there was a little girl named"
EXPECTED = "Lily. She loved to play outside in the park"  # fixtures/README.md


@pytest.fixture(scope="module")
def stories_gguf(fixtures_dir):
    return fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf"


@pytest.fixture(scope="module")
def stories_dir(stories_gguf, tmp_path_factory):
    return gguf_to_hf(stories_gguf, tmp_path_factory.mktemp("stories") / "hf")


def test_stories260k_continues_the_story(stories_dir):
    model = AutoModelForCausalLM.from_pretrained(stories_dir).eval()
    tok = AutoTokenizer.from_pretrained(stories_dir)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids[0, 0].item() == 1  # SentencePiece llama tokenizers prepend BOS
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert text.startswith(EXPECTED), text


def test_stories260k_config_and_sentinel_token_ids(stories_dir):
    cfg = json.loads((stories_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (512, 64, 5)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (8, 4, 8)
    assert cfg["tie_word_embeddings"] is False
    # The file's padding id is the uint32 "none" sentinel 4294967295: imported as absent.
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, None)
    assert json.loads((stories_dir / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    tok = AutoTokenizer.from_pretrained(stories_dir)
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == ("<s>", "</s>", "<unk>", None)
    assert len(tok) == 512
    # Byte fallback: a character outside the 512-token vocabulary round-trips through <0x..> tokens.
    assert tok.decode(tok("a ☃ b").input_ids, skip_special_tokens=True) == "a ☃ b"


def test_hf_source_loads_gguf_and_caches_the_import(stories_gguf, tmp_path):
    first = load_hf_source(stories_gguf, cache_dir=tmp_path)
    assert first.config["architectures"] == ["LlamaForCausalLM"]
    assert first.state["model.layers.4.self_attn.k_proj.weight"].shape == (32, 64)
    assert (first.tokenizer_dir / "tokenizer.json").is_file()
    mtime = (first.tokenizer_dir / "model.safetensors").stat().st_mtime_ns
    second = load_hf_source(stories_gguf, cache_dir=tmp_path)
    assert second.tokenizer_dir == first.tokenizer_dir
    assert (second.tokenizer_dir / "model.safetensors").stat().st_mtime_ns == mtime


# ---- GGUF files written here from a random HF Llama, the way llama.cpp's converter does ----


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (HF rotate-half -> GGUF pairwise)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_llama(tied: bool) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1; random values test their mapping too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def write_gguf(
    path,
    model: LlamaForCausalLM,
    vocab_source,
    kind: str = "F32",
    quantize: str | None = None,
    architecture: str = "llama",
    bos_id: int = 1,
):
    """Write ``model`` as a llama GGUF with llama.cpp's writer (tensor data type ``kind``)."""
    src = gguf.GGUFReader(str(vocab_source))
    c = model.config
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_tokenizer_model("llama")
    w.add_token_list(src.fields["tokenizer.ggml.tokens"].contents())
    w.add_token_scores(src.fields["tokenizer.ggml.scores"].contents())
    w.add_token_types(src.fields["tokenizer.ggml.token_type"].contents())
    w.add_bos_token_id(bos_id)
    w.add_eos_token_id(2)
    w.add_pad_token_id(4294967295)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(c.num_hidden_layers):
        names.update({f"model.layers.{i}.{h}.weight": f"blk.{i}.{g}.weight" for h, g in layer.items()})
    state = model.state_dict()
    if c.tie_word_embeddings:
        del state["lm_head.weight"]
    for hf_name, t in state.items():
        a = t.numpy()
        if ".q_proj." in hf_name:
            a = llamacpp_permute(a, c.num_attention_heads)
        elif ".k_proj." in hf_name:
            a = llamacpp_permute(a, c.num_key_value_heads)
        name = names[hf_name]
        qtype = quantize if name == "blk.1.ffn_up.weight" and quantize else (kind if a.ndim == 2 else "F32")
        if qtype == "F32":
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        elif qtype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), gguf.GGMLQuantizationType[qtype])
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_f32_import_restores_hf_weights_exactly(stories_gguf, tmp_path, tied):
    hf = random_llama(tied)
    out = gguf_to_hf(write_gguf(tmp_path / "m.gguf", hf, stories_gguf), tmp_path / "hf")
    src = load_hf_source(out)
    assert src.config["tie_word_embeddings"] is tied
    expected = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert src.state.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(src.state[name], t), name  # includes the un-permuted q/k rows
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits, hf(ids).logits)


@pytest.mark.parametrize(("kind", "torch_dtype"), [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_half_precision_tensors_import_as_their_float32_values(stories_gguf, tmp_path, kind, torch_dtype):
    hf = random_llama(False)
    src = load_hf_source(gguf_to_hf(write_gguf(tmp_path / "m.gguf", hf, stories_gguf, kind=kind), tmp_path / "hf"))
    for name, t in hf.state_dict().items():
        want = t.to(torch_dtype).float() if t.dim() == 2 else t
        assert src.state[name].dtype == torch.float32
        assert torch.equal(src.state[name], want), name


def test_quantized_tensor_is_rejected_by_name_and_type(stories_gguf, tmp_path):
    path = write_gguf(tmp_path / "q.gguf", random_llama(False), stories_gguf, quantize="Q4_0")
    with pytest.raises(ValueError, match=r"tensor 'blk\.1\.ffn_up\.weight' has type Q4_0; only F32, F16, BF16, Q8_0"):
        gguf_to_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_other_architecture_is_rejected_by_key(stories_gguf, tmp_path):
    path = write_gguf(tmp_path / "g.gguf", random_llama(False), stories_gguf, architecture="gemma")
    with pytest.raises(ValueError, match=r"'general\.architecture'='gemma'"):
        gguf_to_hf(path, tmp_path / "hf")


def test_token_id_outside_vocabulary_is_rejected_by_key(stories_gguf, tmp_path):
    path = write_gguf(tmp_path / "b.gguf", random_llama(False), stories_gguf, bos_id=600)
    with pytest.raises(ValueError, match=r"'tokenizer\.ggml\.bos_token_id'=600 is outside the vocabulary"):
        gguf_to_hf(path, tmp_path / "hf")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "hf")
