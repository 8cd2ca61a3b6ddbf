"""GGUF export: our own import of the written file gives back the exported model (logits within
the measured bounds below) and its tokenizer metadata, for llama, qwen2 and qwen3."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from conversion.gguf import gguf_to_hf
from conversion.gguf_export import GGUF_TYPES, gguf_tensor_name, hf_to_gguf, tokenizer_metadata
from conversion.random_init import init_random_hf_model

# Max |logit difference| of our import of the GGUF against the exported model, divided by the
# std of the exported model's logits (2 x 32 random tokens). Measured here (llama = the
# pretrained stories260K, logit std 8.4; qwen2/qwen3 random-init): f16 1.0e-3 / 1.8e-3 / 2.4e-3,
# bf16 8.1e-3 / 1.3e-2 / 1.8e-2, q8_0 2.4e-2 / 5.1e-2 / 5.8e-2. f32 is exact. Bounds: ~2x the worst.
REL_BOUND = {"f32": 0.0, "f16": 5e-3, "bf16": 3.5e-2, "q8_0": 1.2e-1}
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)


@pytest.fixture(scope="module")
def stories_dir(fixtures_dir, tmp_path_factory):
    return gguf_to_hf(
        fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf", tmp_path_factory.mktemp("stories") / "hf"
    )


@pytest.fixture(scope="module")
def bpe_tokenizer_dir(tmp_path_factory):
    """A 512-token byte-level BPE (what Qwen uses) trained here, with a ChatML template."""
    out = tmp_path_factory.mktemp("bpe")
    bpe = ByteLevelBPETokenizer()
    text = ["Once upon a time there was a little girl who liked to count 1, 2, 3 and sing."] * 50
    bpe.train_from_iterator(text, vocab_size=509, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template
    )
    tok.save_pretrained(out)
    return out


def _model(tmp, arch, stories_dir, bpe_tokenizer_dir):
    if arch == "llama":
        return stories_dir
    extra = {"head_dim": 32, "attention_bias": False} if arch == "qwen3" else {}
    cfg = {"architectures": [f"{arch.capitalize()}ForCausalLM"], "model_type": arch, **TINY, **extra}
    return init_random_hf_model(tmp / arch, cfg, seed=7, tokenizer_dir=bpe_tokenizer_dir)


def _logits(model_dir, ids):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir).eval()(ids).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_import_of_the_export_gives_the_models_logits(arch, stories_dir, bpe_tokenizer_dir, tmp_path):
    model_dir = _model(tmp_path, arch, stories_dir, bpe_tokenizer_dir)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    want = _logits(model_dir, ids)
    if arch == "qwen2":  # qwen2 carries q/k/v biases; make them count
        assert "blk.0.attn_q.bias" in {
            t.name for t in gguf.GGUFReader(hf_to_gguf(model_dir, tmp_path / "b.gguf", "f32")).tensors
        }
    for kind in GGUF_TYPES:
        path = hf_to_gguf(model_dir, tmp_path / f"{kind}.gguf", kind)
        reader = gguf.GGUFReader(str(path))
        assert reader.fields["general.architecture"].contents() == arch
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert types["blk.0.attn_norm.weight"] == "F32"  # 1-D tensors stay F32
        assert types["blk.0.attn_v.weight"] == GGUF_TYPES[kind][0]
        got = _logits(gguf_to_hf(path, tmp_path / kind), ids)
        rel = ((got - want).abs().max() / want.std()).item()
        assert rel <= REL_BOUND[kind], (kind, rel)
    if arch == "qwen3":
        assert types["blk.1.attn_q_norm.weight"] == "F32"
    if arch == "llama":  # stories260K's ffn width 172 is no multiple of Q8_0's 32-value block: F16
        assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q8_0"


def test_stories_gguf_metadata_round_trips_exactly(fixtures_dir, stories_dir, tmp_path):
    """GGUF -> our import -> our export gives the original vocabulary, scores, types and ids."""
    src = gguf.GGUFReader(str(fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf"))
    out = gguf.GGUFReader(str(hf_to_gguf(stories_dir, tmp_path / "s.gguf", "f16")))
    for key in (
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "llama.context_length",
        "llama.rope.dimension_count",
    ):
        assert out.fields[key].contents() == src.fields[key].contents(), key
    assert "tokenizer.ggml.padding_token_id" not in out.fields  # the source's was the "none" sentinel
    assert out.fields["tokenizer.ggml.add_bos_token"].contents() is True
    assert "tokenizer.chat_template" not in out.fields and "tokenizer.ggml.eot_token_id" not in out.fields


def test_byte_level_bpe_metadata_round_trips(bpe_tokenizer_dir, stories_dir, tmp_path):
    model_dir = _model(tmp_path, "qwen2", stories_dir, bpe_tokenizer_dir)
    path = hf_to_gguf(model_dir, tmp_path / "q.gguf", "q8_0")
    f = gguf.GGUFReader(str(path)).fields
    src = AutoTokenizer.from_pretrained(model_dir)
    assert (f["tokenizer.ggml.model"].contents(), f["tokenizer.ggml.pre"].contents()) == ("gpt2", "qwen2")
    n = len(src)  # the trained vocabulary is smaller than the model's 512 rows: the rest are llama.cpp's pads
    assert f["tokenizer.ggml.tokens"].contents() == src.convert_ids_to_tokens(list(range(n))) + [
        f"[PAD{i}]" for i in range(n, 512)
    ]
    merges = json.loads((model_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert f["tokenizer.ggml.merges"].contents() == [" ".join(m) for m in merges]
    im_end = src.convert_tokens_to_ids("<|im_end|>")
    assert f["tokenizer.ggml.eos_token_id"].contents() == f["tokenizer.ggml.eot_token_id"].contents() == im_end
    assert f["tokenizer.ggml.padding_token_id"].contents() == src.convert_tokens_to_ids("<|endoftext|>")
    assert f["tokenizer.ggml.token_type"].contents()[im_end] == gguf.TokenType.CONTROL
    assert f["tokenizer.chat_template"].contents() == src.chat_template
    back = AutoTokenizer.from_pretrained(gguf_to_hf(path, tmp_path / "back"))
    chat = [{"role": "user", "content": "Once 123 times, café"}, {"role": "assistant", "content": "sing!"}]
    text = src.apply_chat_template(chat, tokenize=False)
    assert back.apply_chat_template(chat, tokenize=False) == text
    assert back(text).input_ids == src(text).input_ids
    assert (back.eos_token, back.pad_token) == ("<|im_end|>", "<|endoftext|>")


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_real_qwen_tokenizer_metadata(family, fixtures_dir, tmp_path):
    """The real Qwen2.5 vocabulary (151,665 tokens) with its own and Qwen3's chat template:
    template, turn end, eos and padding ids, padding to the model's 151,936 rows."""
    tok_dir = fixtures_dir / "qwen2.5-tokenizer"
    if family == "qwen3":
        tok_dir = tmp_path / "qwen3"
        tok_dir.mkdir()
        for name in ("vocab.json", "merges.txt"):
            (tok_dir / name).write_bytes((fixtures_dir / "qwen2.5-tokenizer" / name).read_bytes())
        (tok_dir / "tokenizer_config.json").write_bytes(
            (fixtures_dir / "qwen2.5-tokenizer" / "qwen3" / "tokenizer_config.json").read_bytes()
        )
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    meta = tokenizer_metadata(tok_dir, "qwen3" if family == "qwen3" else "qwen2", 151936)
    assert meta["chat_template"] == cfg["chat_template"]
    assert meta["ids"]["eot"] == meta["ids"]["eos"] == 151645  # <|im_end|>
    assert meta["ids"]["pad"] == 151643 and meta["ids"]["bos"] is None and meta["add_bos"] is False
    assert meta["tokens"][151645] == "<|im_end|>" and meta["tokens"][151935] == "[PAD151935]"
    assert meta["token_types"][151935] == gguf.TokenType.UNUSED and len(meta["tokens"]) == 151936
    assert meta["tokens"][:3] == ["!", '"', "#"] and (meta["model"], meta["pre"]) == ("gpt2", "qwen2")
    assert len(meta["merges"]) == 151387


def test_llama_qk_rows_are_permuted_as_llama_cpp_does(stories_dir, tmp_path):
    from conversion.hf_source import load_hf_source

    src = load_hf_source(stories_dir).state["model.layers.0.self_attn.q_proj.weight"]
    reader = gguf.GGUFReader(str(hf_to_gguf(stories_dir, tmp_path / "p.gguf", "f32")))
    got = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, 8 heads
    want = src.numpy().reshape(8, 2, 4, 64).swapaxes(1, 2).reshape(64, 64)
    assert (got == want).all() and not (got == src.numpy()).all()


def test_bad_inputs_give_one_clear_error(stories_dir, tmp_path):
    with pytest.raises(ValueError, match=r"GGUF type 'q4_k' is not supported; choose one of f32, f16, bf16, q8_0"):
        hf_to_gguf(stories_dir, tmp_path / "x.gguf", "q4_k")
    other = tmp_path / "mistral"
    other.mkdir()
    for p in stories_dir.iterdir():
        (other / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(
        ValueError,
        match=r"mistral/config.json: 'architectures'=\['MistralForCausalLM'\] has no GGUF "
        r"writer; supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        hf_to_gguf(other, tmp_path / "x.gguf", "f16")
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.experts.weight' has no GGUF name"):
        gguf_tensor_name("model.layers.0.mlp.experts.weight")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*tmp*"))


def test_the_config_and_the_command_offer_the_types_export_writes():
    """config.export.GgufType (export.gguf, and `posttrain export-gguf --type`, which must not
    import torch to register) lists exactly the types hf_to_gguf writes."""
    import typing

    from config.export import GgufType

    assert list(typing.get_args(GgufType)) == list(GGUF_TYPES) == ["f32", "f16", "bf16", "q8_0"]
