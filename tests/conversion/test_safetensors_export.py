"""SafeTensors export and random initialisation: directories transformers loads back unchanged."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conversion import hf_to_megatron, megatron_to_hf
from conversion.export import write_hf_safetensors
from conversion.hf_source import check_tokenizer_fits, load_hf_source
from conversion.random_init import init_random_hf_model

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 400,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory, fixtures_dir):
    out = tmp_path_factory.mktemp("base") / "qwen2"
    return init_random_hf_model(out, QWEN2, seed=3, tokenizer_dir=fixtures_dir / "qwen2.5-tokenizer")


def logits(model_dir, ids):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir).eval()(ids).logits


def test_random_init_is_seeded_and_loadable(base, tmp_path):
    again = init_random_hf_model(tmp_path / "again", QWEN2, seed=3)
    other = init_random_hf_model(tmp_path / "other", QWEN2, seed=4)
    a, b, c = (load_hf_source(d, tokenizer=base).state for d in (base, again, other))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (base / "model.safetensors").is_file() and (base / "vocab.json").is_file()
    assert not list(base.parent.glob(".*tmp*"))


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_random_init_files_get_the_umasks_mode_not_save_pretraineds_0600(base, tmp_path, fixtures_dir, umask):
    """transformers' save_pretrained writes model.safetensors 0o600 (safetensors' save_file);
    atomic_hf_dir gives every file the umask's mode, so a shared store's readers can load it."""
    old = os.umask(umask)
    try:
        out = init_random_hf_model(tmp_path / "m", QWEN2, seed=3, tokenizer_dir=fixtures_dir / "qwen2.5-tokenizer")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "vocab.json"} <= modes.keys()
    assert modes == {name: 0o666 & ~umask for name in modes}
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    a, b = (load_hf_source(d, tokenizer=base).state for d in (base, out))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_megatron_export_loads_with_identical_logits(base, tmp_path):
    cfg, state, tok_dir = load_hf_source(base)
    out = write_hf_safetensors(tmp_path / "export", cfg, megatron_to_hf(cfg, hf_to_megatron(cfg, state)), tok_dir)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "merges.txt",
        "model.safetensors",
        "tokenizer_config.json",
        "vocab.json",
    ]
    ids = torch.randint(0, 400, (2, 30), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(out, ids), logits(base, ids))
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    assert (
        AutoTokenizer.from_pretrained(out)("hello world").input_ids
        == AutoTokenizer.from_pretrained(base)("hello world").input_ids
    )


def test_bfloat16_export_and_atomic_replace(base, tmp_path):
    cfg, state, tok_dir = load_hf_source(base)
    out = tmp_path / "export"
    write_hf_safetensors(out, cfg, state.items(), tok_dir)
    write_hf_safetensors(out, cfg, state.items(), tok_dir, dtype="bfloat16", generation_config={"eos_token_id": 2})
    reloaded = load_hf_source(out).state
    assert reloaded["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(reloaded["model.embed_tokens.weight"], state["model.embed_tokens.weight"].bfloat16())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary siblings left


def test_failed_export_leaves_no_partial_directory(base, tmp_path):
    cfg, state, tok_dir = load_hf_source(base)

    def broken():
        yield "model.norm.weight", state["model.norm.weight"]
        raise RuntimeError("weight stream broke")

    with pytest.raises(RuntimeError, match="weight stream broke"):
        write_hf_safetensors(tmp_path / "export", cfg, broken(), tok_dir)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        write_hf_safetensors(tmp_path / "export", cfg, state.items(), tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        write_hf_safetensors(tmp_path / "export", cfg, state.items(), tok_dir, dtype="int8")


def test_hf_source_reads_pytorch_bin_and_reports_bad_sources(base, tmp_path):
    cfg, state, _ = load_hf_source(base)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text(json.dumps(cfg))
    torch.save(state, bin_dir / "pytorch_model.bin")
    loaded = load_hf_source(bin_dir, tokenizer=base)
    assert all(torch.equal(loaded.state[k], state[k]) for k in state)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_hf_source(bin_dir)
    gpt2 = tmp_path / "gpt2-tok"  # GPT-2's original OpenAI files: transformers would say "install sentencepiece"
    gpt2.mkdir()
    (gpt2 / "encoder.json").write_text("{}")
    (gpt2 / "vocab.bpe").write_text("#version: 0.2\n")
    with pytest.raises(FileNotFoundError) as info:
        load_hf_source(bin_dir, tokenizer=gpt2)
    assert str(info.value) == (
        f"model.tokenizer: {gpt2} holds encoder.json, vocab.bpe but no tokenizer vocabulary: a tokenizer needs "
        "tokenizer.json, or vocab.json and merges.txt, or tokenizer.model; encoder.json and vocab.bpe are GPT-2's "
        "original files: rename them to vocab.json and merges.txt, or load the tokenizer with transformers and "
        "save_pretrained() it into this folder"
    )
    with pytest.raises(FileNotFoundError, match="config.json: missing"):
        load_hf_source(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        load_hf_source(str(tmp_path / "absent"))


def test_corrupt_weights_and_config_are_named(base, tmp_path):
    """A truncated or garbled weights file, a broken config.json and a tensor in two shards
    each give one error naming the file (and tensor); the convert stage writes nothing."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(base, bad)
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated: the header promises more bytes
    with pytest.raises(ValueError, match=r"model\.safetensors: cannot read the weights \(corrupt or truncated"):
        load_hf_source(bad)
    weights.write_bytes(b"\xff" * 64)  # garbage header length
    with pytest.raises(ValueError, match=r"model\.safetensors: cannot read the weights"):
        load_hf_source(bad)
    weights.write_bytes(data)
    shutil.copy2(weights, bad / "model-00002.safetensors")  # every tensor twice
    with pytest.raises(ValueError, match=r"model.safetensors: tensor '.+' is also in another weights file"):
        load_hf_source(bad)
    (bad / "model-00002.safetensors").unlink()
    (bad / "config.json").write_text('{"vocab_size": 400,\n  "hidden_size": }')
    with pytest.raises(ValueError, match=r"config\.json: invalid JSON at line 2"):
        load_hf_source(bad)


def test_tokenizer_of_another_model_and_a_broken_gguf_are_named(base, fixtures_dir, tmp_path):
    # The random test model here has vocab_size 400; the real Qwen2.5 tokenizer has 151,665 tokens.
    with pytest.raises(
        ValueError, match=r"the tokenizer has 151665 tokens but .*vocab_size=400: model.tokenizer does not"
    ):
        check_tokenizer_fits(load_hf_source(base, tokenizer=fixtures_dir / "qwen2.5-tokenizer"))
    stories = load_hf_source(fixtures_dir / "tiny-model-stories260K" / "stories260K.gguf", cache_dir=tmp_path / "c")
    check_tokenizer_fits(stories)  # 512 tokens, vocab_size 512: fits
    # No vocab_size to compare with: nothing to refuse here (it raised TypeError, int > None).
    check_tokenizer_fits(stories._replace(config={k: v for k, v in stories.config.items() if k != "vocab_size"}))
    fake = tmp_path / "random.gguf"
    fake.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=r"random\.gguf: cannot import this GGUF file"):
        load_hf_source(fake, cache_dir=tmp_path / "cache")
