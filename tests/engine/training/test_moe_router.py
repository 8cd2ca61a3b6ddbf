"""MoE router losses in training (model.moe): megatron's load-balancing and z-losses equal
hand-computed values on a fixed routing, reach the gradient with the weight the train step
gives them, travel with the model directory, and an SFT run on a tiny MoE model logs
per-expert token counts that add up."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import Qwen3MoeConfig

from config.moe import MoERouterConfig
from config.sft import SFTConfig
from conversion.spec import GPTSpec
from engine.batching.collate import collate_tokens
from engine.models.megatron import build_gpt_model
from engine.storage.model_dir import MOE_ROUTER_FILE, load_model_dir, save_model_dir
from engine.training.optimizer_step import accumulate_gradients
from engine.training.sft import encode_sft_dataset, sft_loss, train_sft
from tests.engine.training.test_sft import alpaca_messages, load_tokenizer_dir, write_jsonl

E, TOPK, HIDDEN = 4, 2, 64


def moe_config(vocab_size: int = 300) -> dict:
    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        num_experts=E,
        num_experts_per_tok=TOPK,
        moe_intermediate_size=48,
        intermediate_size=96,
        norm_topk_prob=True,
    )
    return {**cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}


def build(router: MoERouterConfig | None, vocab_size: int = 300):
    return build_gpt_model(GPTSpec.from_hf_config(moe_config(vocab_size)), seed=0, core_attention="sdpa", router=router)


# Router logits of 4 tokens over 4 experts; top-2 sends token 0 to {0, 1}, 1 to {0, 2}, 2 to {1, 2}, 3 to {3, 2}.
LOGITS = [[3.0, 1.0, 0.0, 0.0], [3.0, 0.0, 1.0, 0.0], [0.0, 3.0, 1.0, 0.0], [0.0, 0.0, 1.0, 3.0]]


def softmax(row):
    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


def test_router_losses_equal_hand_computed_values():
    coeff, z_coeff = 0.01, 0.001
    model = build(MoERouterConfig(load_balancing="aux_loss", aux_loss_coeff=coeff, z_loss_coeff=z_coeff)).train()
    router = model.decoder.layers[0].mlp.router
    with torch.no_grad():  # logits = x @ W^T with W the identity on the first 4 hidden units
        router.weight.zero_()
        router.weight[:, :E] = torch.eye(E)
    x = torch.zeros(len(LOGITS), 1, HIDDEN)
    x[:, 0, :E] = torch.tensor(LOGITS)
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    clear_aux_losses_tracker()
    probs, routing_map = router(x)
    assert routing_map.int().tolist() == [[1, 1, 0, 0], [1, 0, 1, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    # Switch / GShard: E * sum_i f_i P_i, f_i = tokens to i / (T * k), P_i = mean softmax probability of i
    t = len(LOGITS)
    f = [2 / (t * TOPK), 2 / (t * TOPK), 3 / (t * TOPK), 1 / (t * TOPK)]
    p = [sum(softmax(row)[i] for row in LOGITS) / t for i in range(E)]
    aux = E * sum(fi * pi for fi, pi in zip(f, p))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS) / t  # ST-MoE z-loss
    tracker = get_moe_layer_wise_logging_tracker()  # megatron records loss / coeff per layer
    assert float(tracker["load_balancing_loss"]["values"][0]) == pytest.approx(aux, rel=1e-6)
    assert float(tracker["z_loss"]["values"][0]) == pytest.approx(z, rel=1e-6)
    # by hand: P = [0.42505, 0.25000, 0.09227, 0.23268], f = [2, 2, 3, 1] / 8, 4 * sum f_i P_i = 0.92980
    assert aux == pytest.approx(0.92980, abs=1e-5)


def _router_input_grad(coeff: float, state: dict, batch):
    """(last router's weight gradient, its input [T, H]) after one accumulate_gradients."""
    router_cfg = MoERouterConfig(load_balancing="aux_loss", aux_loss_coeff=coeff) if coeff else None
    model = build(router_cfg)
    model.load_state_dict(state, strict=False)
    router = model.decoder.layers[-1].mlp.router
    seen = []
    hook = router.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().reshape(-1, HIDDEN)))
    accumulate_gradients(model, [batch], sft_loss)
    hook.remove()
    return router.weight.grad.clone(), router.weight.detach().clone(), seen[0]


def test_aux_loss_reaches_the_gradient_with_weight_one_per_batch_mean():
    base = build(None)
    state = {k: v for k, v in base.state_dict().items() if isinstance(v, torch.Tensor)}
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 12, 7)]
    batch = collate_tokens(ids, [[0] * 3 + [1] * (len(r) - 3) for r in ids], pad_id=0)
    coeff = 0.5
    g0, _, _ = _router_input_grad(0.0, state, batch)
    g1, w, x = _router_input_grad(coeff, state, batch)
    # The main loss is the same forward, so the difference is coeff * d(aux)/dW of this layer
    # (later layers' aux losses do not depend on the last router's weight).
    w = w.clone().requires_grad_(True)
    scores = torch.softmax(x @ w.T, dim=-1)
    top = torch.zeros_like(scores).scatter(1, scores.topk(TOPK, dim=1).indices, 1.0)
    tokens = x.size(0)
    aux = E * ((top.sum(0) / (tokens * TOPK)) * scores.mean(0)).sum()
    (expected,) = torch.autograd.grad(coeff * aux, w)
    assert (g1 - g0).abs().max() > 1e-4  # the loss reached backward
    torch.testing.assert_close(g1 - g0, expected, rtol=1e-4, atol=1e-6)


def test_router_settings_travel_with_the_model_dir_and_sft_logs_expert_loads(tmp_path, fixtures_dir):
    from data.tokenizer_train import train_chat_tokenizer

    rows = alpaca_messages(fixtures_dir, 8)
    tok_dir = train_chat_tokenizer(
        [m["content"] for r in rows for m in r["messages"]], tmp_path / "tok", vocab_size=400
    )
    vocab = len(load_tokenizer_dir(tok_dir))
    router = MoERouterConfig(load_balancing="aux_loss", aux_loss_coeff=0.01, z_loss_coeff=0.001)
    save_model_dir(tmp_path / "base", build(router, vocab), moe_config(vocab), tok_dir)
    assert json.loads((tmp_path / "base" / MOE_ROUTER_FILE).read_text()) == router.model_dump()
    loaded = load_model_dir(tmp_path / "base")
    assert loaded.model.config.moe_aux_loss_coeff == 0.01 and loaded.model.config.moe_z_loss_coeff == 0.001
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    cfg = SFTConfig(steps=1, global_batch_size=8, micro_batch_size=4, packing=True, max_seq_len=64, log_every=1)
    logged = []
    train_sft(tmp_path / "base", data, cfg, tmp_path / "out", None, log_metrics=lambda m, s: logged.append(m))
    from engine.batching.sampler import EpochSampler

    examples = encode_sft_dataset(data, loaded_tokenizer(tmp_path / "base"), 64)  # the rows step 1 drew:
    tokens = sum(len(examples[i][0]) for i in EpochSampler(len(examples), 0, 0, 0).next_indices(8))
    m = logged[0]
    counts = [m[f"moe/tokens_per_expert/e{i}"] for i in range(E)]
    assert sum(counts) == tokens * TOPK
    assert 1.0 <= m["moe/load_imbalance"] <= E / TOPK
    assert m["moe/load_balancing_loss"] >= 1.0 - 1e-6  # E * sum f_i P_i is at least 1 (Switch; equal when balanced)
    assert m["moe/z_loss"] > 0
    assert (tmp_path / "out" / MOE_ROUTER_FILE).is_file()  # the trained model keeps its router settings


def loaded_tokenizer(model_dir):
    from engine.storage.model_dir import load_tokenizer

    return load_tokenizer(model_dir)


def test_router_config_errors_name_the_key():
    with pytest.raises(ValueError, match="model.moe.aux_loss_coeff"):
        MoERouterConfig(load_balancing="aux_loss")
    with pytest.raises(ValueError, match="model.moe.load_balancing"):
        MoERouterConfig(aux_loss_coeff=0.1)
