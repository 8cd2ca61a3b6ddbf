"""Embedding gradients of bf16 weights summed in fp32 on CPU (engine.models.embedding_grad).

Reference: the same lookup's gradient computed in fp64 from the same (bf16-valued) output
gradient. A gradient summed in fp32 and rounded once to bf16 is within one bf16 rounding of
it: relative error <= 2^-8 per element (unit roundoff 2^-9, plus fp32's own far smaller
error), so <= 2^-8 in L2 norm. A row summing thousands of bf16 additions (what torch's CPU
kernel does for a bf16 weight: measured 5% here) cannot meet that bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.embedding_grad import Fp32GradEmbedding, sum_embedding_grads_in_fp32

VOCAB, WIDTH, TOKENS = 50, 64, 32768
ONE_BF16_ROUNDING = 2.0**-8


def lookup_case(seed: int = 0):
    """32,768 lookups of 14 distinct ids (the quickstart's prompts use about that many) and a
    bf16-valued output gradient; the fp64 weight gradient of those lookups."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 14, (TOKENS,), generator=gen)
    grad_out = torch.randn(TOKENS, WIDTH, generator=gen).to(torch.bfloat16)
    exact = torch.zeros(VOCAB, WIDTH, dtype=torch.float64).index_add_(0, ids, grad_out.double())
    return ids, grad_out, exact


def rel_err(grad: torch.Tensor, exact: torch.Tensor) -> float:
    return float((grad.double() - exact).norm() / exact.norm())


def test_fp32_summed_gradient_is_one_bf16_rounding_of_the_exact_sum():
    ids, grad_out, exact = lookup_case()
    weight = torch.randn(VOCAB, WIDTH).to(torch.bfloat16).requires_grad_()
    out = Fp32GradEmbedding.apply(ids, weight)
    assert torch.equal(out, F.embedding(ids, weight.detach()))  # the forward is the plain gather
    out.backward(grad_out)
    assert weight.grad.dtype == torch.bfloat16
    assert torch.equal(weight.grad, exact.float().to(torch.bfloat16))  # fp32 sum rounds like the exact one here
    assert rel_err(weight.grad, exact) <= ONE_BF16_ROUNDING
    assert torch.all(weight.grad[14:] == 0)  # ids never looked up get no gradient


@pytest.mark.parametrize("padding_idx", [3, -47])  # -47 is row 3 of 50, as torch normalises it
def test_nn_embedding_keeps_padding_row_and_gets_the_fp32_sum(padding_idx):
    ids, grad_out, exact = lookup_case(1)
    exact[3] = 0
    emb = torch.nn.Embedding(VOCAB, WIDTH, padding_idx=padding_idx).to(torch.bfloat16)
    assert sum_embedding_grads_in_fp32(emb) == 1
    assert sum_embedding_grads_in_fp32(emb) == 0  # idempotent: already hooked
    emb(ids).backward(grad_out)
    assert torch.all(emb.weight.grad[3] == 0)
    assert rel_err(emb.weight.grad, exact) <= ONE_BF16_ROUNDING


def test_fp32_weights_keep_torchs_kernel_exactly():
    ids, grad_out, _ = lookup_case(2)
    plain = torch.nn.Embedding(VOCAB, WIDTH)
    hooked = torch.nn.Embedding(VOCAB, WIDTH)
    hooked.load_state_dict(plain.state_dict())
    sum_embedding_grads_in_fp32(hooked)
    plain(ids).backward(grad_out.float())
    hooked(ids).backward(grad_out.float())
    assert torch.equal(plain.weight.grad, hooked.weight.grad)


@pytest.mark.parametrize("deterministic", [False, True])  # F.embedding, or weight[ids] (megatron's deterministic mode)
def test_megatron_vocab_embedding_under_mixed_precision(deterministic):
    """The megatron GPTModel's word embedding after ``to_mixed_precision``: its fp32 master
    gradient is the fp32 sum of the gradient that reached the embedding's output, rounded
    once to bf16 (bitwise), for both of megatron's lookup paths."""
    from conversion.spec import GPTSpec
    from engine.models.master_weights import master_params, to_mixed_precision
    from engine.models.megatron import build_gpt_model, gpt_logits

    spec = GPTSpec(
        architecture="qwen2",
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        ffn_hidden_size=64,
        max_position_embeddings=64,
        rope_theta=1e4,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=False,
        head_dim=16,
    )
    model = build_gpt_model(spec, seed=0, core_attention="sdpa")
    to_mixed_precision(model)
    embedding = model.embedding.word_embeddings
    embedding.deterministic_mode = deterministic
    captured = {}

    def keep_output_grad(_module, _inputs, out):
        out.register_hook(lambda g: captured.setdefault("g", g))

    embedding.register_forward_hook(keep_output_grad)
    ids = torch.randint(0, 6, (8, 64), generator=torch.Generator().manual_seed(3))  # 512 lookups of 6 ids
    logits = gpt_logits(model, ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").backward()
    grad_out = captured["g"]  # [B, T, H] or megatron's [T, B, H]
    flat_ids = ids.t() if grad_out.shape[0] == ids.shape[1] else ids
    expected = (
        torch.zeros(embedding.weight.shape, dtype=torch.float32)
        .index_add_(0, flat_ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1]).float())
        .to(torch.bfloat16)
        .float()
    )
    master = master_params(model)["embedding.word_embeddings.weight"]
    assert torch.equal(master.grad, expected)
