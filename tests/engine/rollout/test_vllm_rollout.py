"""vLLM rollout against HF transformers on a tiny random Qwen2 model (one engine per module)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from engine.rollout.base import SamplingSpec
from engine.rollout.vllm_rollout import VLLMRollout, eos_token_ids

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

VOCAB = 400
PROMPTS = [[5, 6, 7], [9, 9], [123, 4, 77, 300, 2]]


def tiny_qwen2(seed: int, eos_id: int = 1) -> Qwen2ForCausalLM:
    """A random 2-layer Qwen2 (hidden 64, head_dim 32, vocab 400), weights scaled up so that
    next-token logits are well separated (greedy choices are not near-ties)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=0,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model


def save_tiny(model: Qwen2ForCausalLM, out: Path) -> Path:
    """save_pretrained plus a word-level tokenizer ("<pad>", "<eos>", "0".."397") built with tokenizers."""
    words = ["<pad>", "<eos>"] + [str(i) for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>").save_pretrained(out)
    return out


def hf_greedy(model, prompt: list[int], max_new: int, eos: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def synced_weights(model):
    """The tensors a trainer streams for a tied model: no ``lm_head.weight`` (as
    ``conversion.registry.megatron_to_hf`` and ``save_pretrained`` omit it), fresh copies."""
    return [(k, v.clone()) for k, v in model.state_dict().items() if k != "lm_head.weight"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Model A with its EOS chosen as the 4th greedy token of prompt 0 (so greedy stops there),
    model B (other random weights, same config), and one vLLM engine started with placeholder
    weights (``load_format="dummy"``, as the RL rollout worker starts) and then given model A."""
    model_a = tiny_qwen2(seed=0)
    greedy = hf_greedy(model_a, PROMPTS[0], 12, eos=-1)
    eos = greedy[3]
    assert eos not in greedy[:3], "pick another seed: the chosen EOS already appears earlier"
    model_a.config.eos_token_id = model_a.generation_config.eos_token_id = eos
    model_b = tiny_qwen2(seed=1, eos_id=eos)
    path = save_tiny(model_a, tmp_path_factory.mktemp("tiny_qwen2"))
    # the KV cache for the largest call below: 3 prompts x 4 samples
    engine = VLLMRollout(path, num_sequences=12, max_model_len=128, load_format="dummy")
    engine.update_weights(synced_weights(model_a))
    return engine, model_a, model_b, eos


def test_kv_cache_is_the_size_asked_for(setup):
    """vLLM honours the explicit kv_cache_memory_bytes and cuts it into the blocks the hand
    count predicts (its block size and max_num_seqs are the ones engine.rollout.kv_cache assumes)."""
    engine = setup[0]
    # per token: 2 layers x 2 (K and V) x 1 KV head x 32 dims x 4 bytes = 512 bytes; a 128-token block 65,536
    # 12 sequences x 1 block + 1 null block = 13 blocks = 851,968 bytes; +10% = 937,164.8 -> 937,165
    assert engine.kv_cache_memory_bytes == 937_165
    vllm_config = engine.llm.llm_engine.vllm_config
    assert vllm_config.cache_config.kv_cache_memory_bytes == 937_165
    assert vllm_config.cache_config.block_size == 128 and vllm_config.scheduler_config.max_num_seqs == 12
    assert vllm_config.cache_config.num_gpu_blocks == 937_165 // 65_536 == 14


def test_eos_from_model_dir(setup, tmp_path):
    engine, _, _, eos = setup
    assert engine.eos_token_ids == [eos]
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert eos_token_ids(tmp_path) == [3, 4]
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no eos_token_id"):
        eos_token_ids(tmp_path)


def test_greedy_matches_hf_and_stops_at_eos(setup):
    engine, model_a, _, eos = setup
    outs = engine.generate(PROMPTS, SamplingSpec(n=1, temperature=0.0, max_new_tokens=12))
    assert [len(o) for o in outs] == [1, 1, 1]
    for prompt, (o,) in zip(PROMPTS, outs):
        expected = hf_greedy(model_a, prompt, 12, eos)
        assert list(o.token_ids) == expected
        assert o.finish_reason == ("stop" if expected[-1] == eos else "length")
        torch.testing.assert_close(
            torch.tensor(o.logprobs, dtype=torch.float64), hf_logprobs(model_a, prompt, expected), rtol=0, atol=1e-4
        )
    first = outs[0][0]
    assert len(first.token_ids) == 4 and first.token_ids[-1] == eos and first.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_hf(setup, temperature):
    engine, model_a, _, eos = setup
    spec = SamplingSpec(n=4, temperature=temperature, max_new_tokens=10, seed=3)
    outs = engine.generate(PROMPTS, spec)
    assert [len(o) for o in outs] == [4, 4, 4]
    distinct = {o.token_ids for group in outs for o in group}
    assert len(distinct) == 12  # every sample its own random stream
    for prompt, group in zip(PROMPTS, outs):
        for o in group:
            assert len(o.logprobs) == len(o.token_ids) >= 1
            assert (o.finish_reason == "stop") == (o.token_ids[-1] == eos)
            ref = hf_logprobs(model_a, prompt, list(o.token_ids), temperature)
            torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float64), ref, rtol=0, atol=1e-4)
    # the same seed reproduces the same samples
    assert engine.generate(PROMPTS, spec) == outs


def test_update_weights_switches_policy(setup):
    engine, model_a, model_b, eos = setup
    spec = SamplingSpec(n=1, temperature=0.0, max_new_tokens=12)
    before = engine.generate(PROMPTS, spec)
    # a generator, as streamed from the trainer; the tied output layer must follow the embedding
    engine.update_weights(kv for kv in synced_weights(model_b))
    after = engine.generate(PROMPTS, spec)
    assert [o[0].token_ids for o in after] != [o[0].token_ids for o in before]
    for prompt, (o,) in zip(PROMPTS, after):
        expected = hf_greedy(model_b, prompt, 12, eos)
        assert list(o.token_ids) == expected
        torch.testing.assert_close(
            torch.tensor(o.logprobs, dtype=torch.float64), hf_logprobs(model_b, prompt, expected), rtol=0, atol=1e-4
        )
    engine.update_weights(synced_weights(model_a))
    assert engine.generate(PROMPTS, spec) == before


def test_update_weights_bucket_by_bucket(setup):
    """One reload call per bucket of ``engine.models.weight_buckets`` (modules never split across
    calls) ends with the same policy as one full update; the tied output layer follows the
    embedding's bucket."""
    from engine.models.weight_buckets import plan_buckets

    engine, model_a, model_b, eos = setup
    spec = SamplingSpec(n=1, temperature=0.0, max_new_tokens=12)
    weights = synced_weights(model_b)
    plan = plan_buckets(((name, t.shape, t.dtype) for name, t in weights), bucket_bytes=20_000)
    assert plan.num_buckets > 3
    try:
        for i in range(plan.num_buckets):
            engine.update_weights(weights[plan.starts[i] : plan.starts[i + 1]])
        for prompt, (o,) in zip(PROMPTS, engine.generate(PROMPTS, spec)):
            expected = hf_greedy(model_b, prompt, 12, eos)
            assert list(o.token_ids) == expected
            torch.testing.assert_close(
                torch.tensor(o.logprobs, dtype=torch.float64), hf_logprobs(model_b, prompt, expected), rtol=0, atol=1e-4
            )
    finally:
        engine.update_weights(synced_weights(model_a))


def test_empty_prompt_rejected(setup):
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        setup[0].generate([[3], []], SamplingSpec())


def test_valid_vocab_size_masks_padding_rows(setup):
    """With a padded embedding only ids below ``valid_vocab_size`` are sampled, and the
    reported log-probs are normalised over those ids."""
    engine, model_a, _, _ = setup
    engine.valid_vocab_size = 50
    try:
        outs = engine.generate(PROMPTS, SamplingSpec(n=4, temperature=1.0, max_new_tokens=6, seed=11))
    finally:
        engine.valid_vocab_size = None
    for prompt, group in zip(PROMPTS, outs):
        for o in group:
            assert max(o.token_ids) < 50
            ids = torch.tensor([prompt + list(o.token_ids)])
            with torch.no_grad():
                logits = model_a(ids).logits[0, len(prompt) - 1 : -1, :50].double()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float64), ref, rtol=0, atol=1e-4)


def test_a_share_of_the_batch_samples_what_the_whole_batch_does(setup):
    """A rollout router gives each engine a share of a step's prompts with their places in the
    batch (``SamplingSpec.prompt_index``): every sample is seeded by its place, so a share
    samples the tokens the whole batch samples for its prompts. That vLLM's logits also do not
    depend on the batch (batch invariance) is not promised; on this CPU and model they agree:
    tokens equal, log-probs within fp32 noise."""
    engine = setup[0]
    spec = SamplingSpec(n=4, temperature=1.0, max_new_tokens=10, seed=5)
    whole = engine.generate(PROMPTS, spec)
    share = engine.generate([PROMPTS[2], PROMPTS[0]], replace(spec, prompt_index=(2, 0)))
    for i, group in zip((2, 0), share):
        assert [o.token_ids for o in group] == [o.token_ids for o in whole[i]]
        for o, ref in zip(group, whole[i]):
            torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=1e-5)
    # without the places the share would draw the streams of places 0 and 1
    assert [o.token_ids for o in engine.generate([PROMPTS[2]], spec)[0]] != [o.token_ids for o in whole[2]]


def test_enforce_eager_unset_is_eager_on_cpu_and_compiled_on_cuda(setup, monkeypatch):
    """rl.rollout.enforce_eager: null (the default). The shared engine was started without the
    argument: on this CPU build of vLLM it runs eagerly, and vLLM was told so. On a CUDA (or
    ROCm) platform the default is vLLM's own, compiled with CUDA graphs; the platform object is
    the one thing replaced, as no CUDA device exists here."""
    from vllm.platforms import current_platform

    from engine.rollout.vllm_rollout import default_enforce_eager

    engine = setup[0]
    assert current_platform.is_cpu()
    assert engine.enforce_eager is True
    assert engine.llm.llm_engine.vllm_config.model_config.enforce_eager is True
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: True)
    assert default_enforce_eager() is False


def test_a_compiled_engine_follows_weight_updates(setup, tmp_path):
    """rl.rollout.enforce_eager: false. vLLM compiles the model at start-up (torch.compile on
    CPU); weights streamed in afterwards (dummy start, model A, then B, then A again, as an RL
    run pushes them) are the ones the compiled model computes with: its greedy tokens equal HF's
    under each model and its log-probs are within 1e-4 of HF's, as the eager engine's are."""
    _, model_a, model_b, eos = setup
    path = save_tiny(model_a, tmp_path / "tiny_qwen2")
    engine = VLLMRollout(path, num_sequences=3, max_model_len=128, load_format="dummy", enforce_eager=False)
    assert engine.enforce_eager is False and engine.llm.llm_engine.vllm_config.model_config.enforce_eager is False
    spec = SamplingSpec(n=1, temperature=0.0, max_new_tokens=12)
    for model in (model_a, model_b, model_a):
        engine.update_weights(synced_weights(model))
        outs = engine.generate(PROMPTS, spec)
        for prompt, (o,) in zip(PROMPTS, outs):
            expected = hf_greedy(model, prompt, 12, eos)
            assert list(o.token_ids) == expected
            torch.testing.assert_close(
                torch.tensor(o.logprobs, dtype=torch.float64), hf_logprobs(model, prompt, expected), rtol=0, atol=1e-4
            )
