"""HFRollout against independent references: HF ``generate``, teacher-forced forward passes,
the softmax it samples from, and a freshly loaded model for weight updates."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from engine.rollout.base import SamplingSpec
from engine.rollout.hf_rollout import HFRollout
from tests.numerics import ROUNDING_FACTOR, fp64_reference

PAD = 0
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18, 19, 20]]
MAX_NEW = 12


def _tiny_qwen2(seed: int, eos: int = 2) -> Qwen2ForCausalLM:
    # initializer_range 0.3 gives peaked next-token distributions (top token ~40%), so
    # greedy choices are not near-ties and temperature visibly changes the distribution.
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        initializer_range=0.3,
        eos_token_id=eos,
        pad_token_id=PAD,
    )
    return Qwen2ForCausalLM(cfg).eval()


def _hf_greedy(model, prompt: list[int], max_new: int, eos: int) -> tuple[int, ...]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos,
        pad_token_id=PAD,
    )
    return tuple(out[0, len(prompt) :].tolist())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 whose EOS is a token greedy decoding reaches from the first prompt."""
    model = _tiny_qwen2(seed=0)
    # Pick as EOS the 4th greedy token of prompt 0, so at least one sequence stops early.
    free_run = _hf_greedy(model, PROMPTS[0], MAX_NEW, eos=model.config.vocab_size + 1)
    eos = free_run[3]
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    path = tmp_path_factory.mktemp("tiny_qwen2")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rollout(model_dir):
    return HFRollout(model_dir)


def _teacher_forced_logprobs(model, prompt, response, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(response)])).logits[0]  # fp32, or fp64 for the exact reference
    step_logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]
    logp = torch.log_softmax(step_logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_reads_eos_and_pad_from_the_directory(rollout, model_dir):
    reference = Qwen2ForCausalLM.from_pretrained(model_dir)
    assert rollout.eos_token_ids == (reference.config.eos_token_id,)
    assert rollout.pad_token_id == PAD


def test_greedy_equals_hf_generate(rollout, model_dir):
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    eos = reference.config.eos_token_id
    outputs = rollout.generate(PROMPTS, SamplingSpec(n=1, temperature=0.0, max_new_tokens=MAX_NEW))
    assert [len(o) for o in outputs] == [1, 1, 1, 1]
    for prompt, (out,) in zip(PROMPTS, outputs):
        assert out.token_ids == _hf_greedy(reference, prompt, MAX_NEW, eos)
    # The EOS case: prompt 0 stops after 4 tokens, EOS kept as the last token.
    first = outputs[0][0]
    assert len(first.token_ids) == 4 and first.token_ids[-1] == eos and first.finish_reason == "stop"
    for (out,) in outputs:
        assert out.finish_reason == ("stop" if eos in out.token_ids else "length")
        assert (len(out.token_ids) == MAX_NEW) or out.finish_reason == "stop"
        assert eos not in out.token_ids[:-1]

    # Batched, left-padded HF generate agrees too (finished rows are padded by HF).
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    batched = reference.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=PAD
    )
    for row, (out,) in enumerate(outputs):
        hf_row = batched[row, width:].tolist()
        assert tuple(hf_row[: len(out.token_ids)]) == out.token_ids
        assert all(t == PAD for t in hf_row[len(out.token_ids) :])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_teacher_forced_forward(rollout, model_dir, temperature):
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    outputs = rollout.generate(PROMPTS, SamplingSpec(n=2, temperature=temperature, max_new_tokens=MAX_NEW, seed=5))
    # Greedy reports the model's own (temperature-1) distribution.
    scale = temperature if temperature > 0 else 1.0
    checked, errs, roundings = 0, [], []
    for prompt, samples in zip(PROMPTS, outputs):
        assert len(samples) == 2
        for s in samples:
            assert len(s.logprobs) == len(s.token_ids) >= 1
            # Teacher-forced transformers in float64 is the exact answer (tests/numerics.py:
            # fp32 rounding differs between CPUs).
            ref = fp64_reference(reference, lambda m: _teacher_forced_logprobs(m, prompt, s.token_ids, scale))
            assert ref.fp32.dtype == torch.float32
            errs.append(ref.error(torch.tensor(s.logprobs)))
            roundings.append(ref.hf_rounding)
            checked += len(s.token_ids)
    assert checked >= 8 * 4
    # The rollout decodes incrementally (KV cache, left-padded batch), so its rounding is not
    # the teacher-forced pass's token by token; over all samples it must be within
    # max(1e-5, 2 x the worst fp32 error transformers itself makes on them here).
    bound = max(1e-5, ROUNDING_FACTOR * max(roundings))
    print(
        f"T={temperature}: rollout logprobs vs exact (fp64) = {max(errs):.3e}; teacher-forced fp32 vs exact = "
        f"{max(roundings):.3e}; bound {bound:.3e}"
    )
    assert max(errs) <= bound


def test_sampling_is_seeded(rollout):
    spec = SamplingSpec(n=3, temperature=1.0, max_new_tokens=MAX_NEW, seed=11)
    a = rollout.generate(PROMPTS, spec)
    b = rollout.generate(PROMPTS, spec)
    c = rollout.generate(PROMPTS, SamplingSpec(n=3, temperature=1.0, max_new_tokens=MAX_NEW, seed=12))
    assert a == b
    assert [s.token_ids for g in a for s in g] != [s.token_ids for g in c for s in g]
    # The n samples of one prompt are not copies of each other.
    assert len({s.token_ids for s in a[0]}) > 1


def test_sampled_frequencies_follow_the_tempered_softmax(model_dir):
    """One-step draws: counts match N*softmax(logits/T) within 5 sigma for every token."""
    engine = HFRollout(model_dir, max_batch_size=1024)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    prompt, draws, temperature = PROMPTS[1], 4000, 0.5
    (samples,) = engine.generate([prompt], SamplingSpec(n=draws, temperature=temperature, max_new_tokens=1, seed=3))
    counts = torch.bincount(torch.tensor([s.token_ids[0] for s in samples]), minlength=97).double()
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0, -1].double()
    p = torch.softmax(logits / temperature, dim=-1)
    sigma = torch.sqrt(draws * p * (1 - p))
    assert torch.all((counts - draws * p).abs() <= 5 * sigma + 1)
    # The check can tell temperatures apart: the T=1 top-token probability is far outside it.
    p1 = torch.softmax(logits, dim=-1)
    top = int(torch.argmax(p))
    assert abs(draws * p1[top] - draws * p[top]) > 5 * sigma[top] + 1


def test_top_p_samples_only_from_the_nucleus(model_dir):
    engine = HFRollout(model_dir, max_batch_size=1024)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    prompt, top_p = PROMPTS[2], 0.8
    (samples,) = engine.generate([prompt], SamplingSpec(n=2000, temperature=1.0, top_p=top_p, max_new_tokens=1, seed=4))
    with torch.no_grad():
        probs = torch.softmax(reference(torch.tensor([prompt])).logits[0, -1].double(), dim=-1)
    # Nucleus by hand: most likely tokens until their mass first reaches top_p.
    nucleus, mass = set(), 0.0
    for tok in torch.argsort(probs, descending=True).tolist():
        nucleus.add(tok)
        mass += float(probs[tok])
        if mass >= top_p:
            break
    assert 1 < len(nucleus) < 97
    seen = {s.token_ids[0] for s in samples}
    assert seen <= nucleus
    smallest = min(float(probs[t]) for t in nucleus) / mass
    assert (1 - smallest) ** 2000 < 1e-6  # so every nucleus token is expected to appear
    assert seen == nucleus
    # Log-probabilities are those of the distribution sampled from: renormalized over the nucleus.
    for s in samples[:50]:
        assert math.isclose(s.logprobs[0], math.log(probs[s.token_ids[0]] / mass), abs_tol=1e-5)
    assert mass < 0.95  # the renormalization is visible at this tolerance


def test_chunking_does_not_change_greedy_outputs(model_dir, rollout):
    spec = SamplingSpec(n=2, temperature=0.0, max_new_tokens=MAX_NEW)
    small = HFRollout(model_dir, max_batch_size=3).generate(PROMPTS, spec)
    assert [[s.token_ids for s in g] for g in small] == [
        [s.token_ids for s in g] for g in rollout.generate(PROMPTS, spec)
    ]


def test_update_weights_matches_a_fresh_load(model_dir, tmp_path):
    engine = HFRollout(model_dir)
    other = _tiny_qwen2(seed=1, eos=Qwen2ForCausalLM.from_pretrained(model_dir).config.eos_token_id)
    other_dir = tmp_path / "other"
    other.save_pretrained(other_dir)

    greedy = SamplingSpec(n=1, temperature=0.0, max_new_tokens=MAX_NEW)
    sampled = SamplingSpec(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=9)
    before = engine.generate(PROMPTS, greedy)

    engine.update_weights((name, t.clone()) for name, t in other.state_dict().items())
    after = engine.generate(PROMPTS, greedy)
    fresh = HFRollout(other_dir)
    assert after != before
    assert after == fresh.generate(PROMPTS, greedy)
    assert engine.generate(PROMPTS, sampled) == fresh.generate(PROMPTS, sampled)
    for name, t in other.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t)


def test_update_weights_is_strict(model_dir):
    engine = HFRollout(model_dir)
    q = engine.model.state_dict()["model.layers.0.self_attn.q_proj.weight"].clone()
    good = ("model.layers.0.self_attn.q_proj.weight", torch.zeros_like(q))
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights([good, ("model.layers.9.mlp.up_proj.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"q_proj.weight.*\(3, 3\)"):
        engine.update_weights([good, ("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))])
    # Nothing was copied by the failed updates.
    assert torch.equal(engine.model.state_dict()["model.layers.0.self_attn.q_proj.weight"], q)


def test_bad_inputs(model_dir, tmp_path, rollout):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        rollout.generate([[5], []], SamplingSpec())
    with pytest.raises(ValueError, match="prompt 0 has token ids outside"):
        rollout.generate([[5, 97]], SamplingSpec())
    with pytest.raises(ValueError, match="top_p"):
        rollout.generate([[5]], SamplingSpec(top_p=0.0))
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFRollout(tmp_path)
