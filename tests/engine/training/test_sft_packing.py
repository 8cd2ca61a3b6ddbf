"""Sequence packing and token-budget micro-batches for SFT and the reward model.

In fp32 (pinned), packed micro-batches give the same loss sum, the same unit count and the
same gradients as one right-padded batch, for sequences of different lengths and several
micro-batch splits; so do the trainers end to end.

Tolerance: 1e-6 relative. Packed and padded runs compute the same terms in a different
order (per-sequence attention instead of one masked batch, a cross entropy over the target
positions only instead of a masked one over every position), so they differ by fp32
rounding only: a few ulps (2^-23 ~ 1.2e-7) per operation, measured here at 1-2e-7 relative
for the gradients and below 1e-7 for the losses (splitting a padded batch into micro-batches
alone gives the same 1e-7).
A real defect (a token predicted across a sequence boundary, a wrong position id, a
dropped or double-counted target, the reward read at the wrong token) moves the loss and the
gradients by 1e-3 or more.
"""

from __future__ import annotations

import pytest
import torch

from config.rm import RMConfig
from config.sft import SFTConfig
from config.training import OptimConfig
from conversion.spec import GPTSpec
from engine.backends.select_rm import reward_trainer
from engine.batching.collate import collate_tokens
from engine.batching.packing import PackedTokenBatch, pack_token_batch
from engine.models.heads import RewardModel
from engine.models.megatron import build_gpt_model
from engine.storage.model_dir import load_model_dir
from engine.training.optimizer_step import accumulate_gradients, build_model_optimizer
from engine.training.reward_model import packed_rewards, pair_loss, reward_micro_batches, train_reward_model
from engine.training.sft import sft_loss, sft_micro_batches, train_sft

VOCAB = 101
REL = 1e-6  # fp32 rounding of a reordered computation (module docstring)


def tiny_gpt(seed: int = 3):
    """Qwen2-shaped GPTModel (QKV bias, GQA 4/2, tied), hidden 64, 2 layers, fp32, sdpa."""
    spec = GPTSpec(
        architecture="qwen2",
        vocab_size=VOCAB,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        ffn_hidden_size=96,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    )
    return build_gpt_model(spec, seed=seed, core_attention="sdpa")


def pin_fp32(model: torch.nn.Module) -> None:
    """Prepare ``model`` for training in fp32 explicitly (no masters, fp32 weights), so the
    comparison holds on machines where ``auto`` resolves to bf16."""
    build_model_optimizer(model, OptimConfig(), 1, precision="fp32")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def sft_rows(lengths: list[int], seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Conversations of the given lengths: a prompt (no target) then an answer (targets)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        prompt = int(torch.randint(1, n, (1,), generator=gen)) if n > 1 else 1
        rows.append((ids, [0] * prompt + [1] * (n - prompt)))
    return rows


def grads_of(model: torch.nn.Module, micro, loss_fn):
    loss, units, metrics = accumulate_gradients(model, micro, loss_fn)
    return loss, units, metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(reference, other, name: str) -> None:
    loss, units, metrics, grads = reference
    loss_b, units_b, metrics_b, grads_b = other
    assert units_b == units, name
    assert abs(loss_b - loss) <= REL * abs(loss), (name, loss_b, loss)
    for key, value in metrics.items():
        assert metrics_b[key] == pytest.approx(value, rel=REL, abs=REL), (name, key)
    # Relative error of the whole gradient (every parameter's, as one vector), in L2 norm and
    # entrywise against its largest entry. Not per tensor: some entries' exact gradient is 0
    # (a key bias: softmax ignores a shift of all scores), so only rounding is left in them.
    assert grads_b.keys() == grads.keys()
    g = torch.cat([v.flatten() for v in grads.values()])
    diff = torch.cat([(grads_b[k] - v).flatten() for k, v in grads.items()])
    assert diff.norm().item() <= REL * g.norm().item(), (name, diff.norm().item(), g.norm().item())
    assert diff.abs().max().item() <= REL * g.abs().max().item(), (name, diff.abs().max().item())


def data_loss(model_dir, dataset) -> float:
    """Token-mean SFT loss of a model directory on a dataset (one padded batch, no grad)."""
    from engine.storage.model_dir import load_tokenizer
    from engine.training.sft import encode_sft_dataset

    rows = encode_sft_dataset(dataset, load_tokenizer(model_dir), 64)
    with torch.no_grad():
        total, units, _ = sft_loss(
            load_model_dir(model_dir).model, collate_tokens([r[0] for r in rows], [r[1] for r in rows])
        )
    return float(total) / units


def test_pack_token_batch_by_hand():
    batch = collate_tokens([[5, 6, 7], [8, 9], [1, 2, 3, 4]], [[1, 0, 1], [1, 1], [0, 0, 1, 1]], pad_id=0)
    packed = pack_token_batch(batch)
    assert isinstance(packed, PackedTokenBatch) and len(packed) == 3 and packed.num_tokens == 9
    assert packed.packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert packed.packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # every sequence's first token is no target (even where its mask says 1): nothing predicts it
    assert packed.loss_mask.tolist() == [0, 0, 1, 0, 1, 0, 0, 1, 1]
    assert int(packed.loss_mask.sum()) == int(batch.loss_mask[:, 1:].sum()) == 4
    assert packed.lengths.tolist() == [3, 2, 4]


def test_sft_loss_and_gradients_do_not_depend_on_packing_or_split():
    model = tiny_gpt()
    pin_fp32(model)
    rows = sft_rows([1, 9, 23, 4, 17, 2, 30, 11, 6, 14, 3, 20], seed=1)  # 160 tokens; a 1-token row has no target
    n = len(rows)
    runs = {
        "padded": SFTConfig(global_batch_size=n, micro_batch_size=n, precision="fp32"),
        "packed_rows": SFTConfig(global_batch_size=n, micro_batch_size=4, packing=True, precision="fp32"),
        "packed_budget": SFTConfig(global_batch_size=n, packing=True, max_tokens_per_micro_batch=40, precision="fp32"),
        "packed_one_row": SFTConfig(global_batch_size=n, packing=True, max_tokens_per_micro_batch=1, precision="fp32"),
        "padded_budget": SFTConfig(global_batch_size=n, max_tokens_per_micro_batch=40, precision="fp32"),
    }
    micro = {name: sft_micro_batches(rows, cfg, pad_id=0) for name, cfg in runs.items()}
    assert len(micro["padded"]) == 1 and len(micro["packed_rows"]) == 3 and len(micro["packed_one_row"]) == n
    assert len(micro["packed_budget"]) >= 4 and all(mb.num_tokens <= 40 for mb in micro["packed_budget"])
    assert all(isinstance(mb, PackedTokenBatch) for mb in micro["packed_budget"])
    reference = grads_of(model, micro.pop("padded"), sft_loss)
    assert reference[1] == sum(sum(m[1:]) for _, m in rows)  # targets: the answer tokens after position 0
    assert max(g.abs().max().item() for g in reference[3].values()) > 1e-3  # gradients are not trivially zero
    for name, mbs in micro.items():
        assert_same(reference, grads_of(model, mbs, sft_loss), name)


def test_reward_model_loss_and_gradients_do_not_depend_on_packing_or_split():
    model = RewardModel(tiny_gpt(), 64, seed=2)
    pin_fp32(model)
    gen = torch.Generator().manual_seed(4)
    lengths = [(5, 9), (14, 3), (1, 2), (21, 20), (7, 7), (2, 16), (11, 4), (9, 13)]
    pairs = [
        (torch.randint(1, VOCAB, (c,), generator=gen).tolist(), torch.randint(1, VOCAB, (r,), generator=gen).tolist())
        for c, r in lengths
    ]
    n = len(pairs)
    runs = {
        "padded": RMConfig(global_batch_size=n, micro_batch_size=n, precision="fp32"),
        "packed_rows": RMConfig(global_batch_size=n, micro_batch_size=2, packing=True, precision="fp32"),
        "packed_budget": RMConfig(global_batch_size=n, packing=True, max_tokens_per_micro_batch=36, precision="fp32"),
        "padded_budget": RMConfig(global_batch_size=n, max_tokens_per_micro_batch=36, precision="fp32"),
    }
    micro = {name: reward_micro_batches(pairs, cfg, pad_id=0) for name, cfg in runs.items()}
    assert len(micro["padded"]) == 1 and len(micro["packed_rows"]) == 4 and len(micro["packed_budget"]) >= 4
    assert all(mb.num_tokens <= 36 or len(mb) == 2 for mb in micro["packed_budget"])  # one pair of 41 runs alone

    # the rewards: each sequence's last token, packed as padded
    padded = micro["padded"][0]
    with torch.no_grad():
        r_padded = model(padded.input_ids, padded.lengths)
        r_packed = packed_rewards(model, pack_token_batch(padded))
    assert r_packed.dtype == torch.float32 and r_packed.shape == (2 * n,)
    assert (r_packed - r_padded).abs().max().item() <= REL * r_padded.abs().max().item()

    reference = grads_of(model, micro.pop("padded"), pair_loss)
    assert reference[1] == n and set(reference[2]) == {"accuracy", "margin"}
    assert reference[3]["reward_head.weight"].abs().max().item() > 1e-3
    for name, mbs in micro.items():
        assert_same(reference, grads_of(model, mbs, pair_loss), name)


def test_packed_rewards_need_the_megatron_reward_model():
    batch = pack_token_batch(collate_tokens([[1, 2], [3]], None, pad_id=0))
    with pytest.raises(ValueError, match="rm.packing needs the megatron reward model"):
        packed_rewards(lambda ids, lengths: ids.float().sum(-1), batch)
    with pytest.raises(ValueError, match="rm.packing needs rm.backend: megatron"):
        RMConfig(packing=True, backend="deepspeed")


def test_trainers_give_the_same_run_packed_or_padded(quickstart_inputs):
    """train_sft and train_reward_model end to end on the quickstart-shaped data (fp32): the
    same unit counts exactly, the same first-step loss to 1e-6 relative (computed before any
    update: the packed-vs-padded rounding alone), the later steps' losses and the written
    model's loss on the data to 1e-5. Not the weights entry by entry: where a gradient is 0
    in exact arithmetic (the key biases, see :func:`assert_same`), AdamW divides rounding
    noise by its own root mean square and moves the weight by +-lr either way; those moves
    change no output, which is what the losses compare."""
    base, root = quickstart_inputs["base"], quickstart_inputs["base"].parent
    optim = OptimConfig(lr=3e-3, warmup_steps=1)
    runs = {}
    for name, extra in {"padded": {}, "packed": {"packing": True, "max_tokens_per_micro_batch": 300}}.items():
        cfg = SFTConfig(
            steps=3,
            global_batch_size=32,
            micro_batch_size=8,
            max_seq_len=64,
            optim=optim,
            precision="fp32",
            log_every=1,
            **extra,
        )
        logged: list[dict] = []
        final = train_sft(
            base,
            quickstart_inputs["sft"],
            cfg,
            root / f"sft_{name}",
            None,
            seed=0,
            log_metrics=lambda m, s: logged.append(m),
        )
        runs[name] = (
            final,
            [m["train/loss"] for m in logged],
            data_loss(root / f"sft_{name}", quickstart_inputs["sft"]),
        )
    (final_a, losses_a, after_a), (final_b, losses_b, after_b) = runs["padded"], runs["packed"]
    assert final_b["train/tokens"] == final_a["train/tokens"] > 0
    assert abs(losses_b[0] - losses_a[0]) <= REL * losses_a[0]
    assert losses_b == pytest.approx(losses_a, rel=1e-5) and losses_a[-1] < losses_a[0]
    assert after_b == pytest.approx(after_a, rel=1e-5) and after_a < losses_a[0]

    rm = {}
    for name, extra in {"padded": {}, "packed": {"packing": True, "max_tokens_per_micro_batch": 200}}.items():
        cfg = RMConfig(
            steps=2,
            global_batch_size=16,
            micro_batch_size=8,
            max_seq_len=64,
            optim=optim,
            precision="fp32",
            log_every=1,
            **extra,
        )
        logged = []
        train_reward_model(
            reward_trainer,
            base,
            quickstart_inputs["preference"],
            cfg,
            root / f"rm_{name}",
            seed=0,
            log_metrics=lambda m, s: logged.append(m),
        )
        rm[name] = logged
    for a, b in zip(rm["padded"], rm["packed"]):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
        # train/accuracy is a pair-weighted mean over the micro-batches (float rounding); the
        # held-out accuracy is a count of pairs, exact
        assert (
            b["train/accuracy"] == pytest.approx(a["train/accuracy"], abs=1e-6) and b["rm/accuracy"] == a["rm/accuracy"]
        )
        assert b["rm/loss"] == pytest.approx(a["rm/loss"], rel=1e-5)
    assert abs(rm["packed"][0]["train/loss"] - rm["padded"][0]["train/loss"]) <= REL * rm["padded"][0]["train/loss"]
