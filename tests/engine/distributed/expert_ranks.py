"""What tests/engine/distributed/test_expert_parallel*.py run on the ranks of an expert-parallel
group (a module of its own: the Ray ranks import it by name)."""

from __future__ import annotations


def expert_flags(spec_config: dict) -> list[dict[str, tuple[list[int], bool, float]]]:
    """On every rank of an EP group: the model built as the stages build it; each rank's
    ``{name: (shape, allreduce flag, sum of the weight)}``, gathered (a collective)."""
    import torch.distributed as dist

    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model

    model = build_gpt_model(GPTSpec.from_hf_config(spec_config), seed=0, core_attention="sdpa")
    mine = {
        n: (list(p.shape), bool(getattr(p, "allreduce", True)), float(p.detach().double().sum()))
        for n, p in model.named_parameters()
    }
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def rm_first_step_micro_batches(cfg, model_dir, dataset) -> tuple:
    """``(tokenizer, micro-batches)`` of the rm stage's first step as ``train_reward_model`` forms
    them (seed 0): every rank's, before the data-parallel share."""
    from engine.batching.collate import pad_token_id
    from engine.batching.sampler import EpochSampler
    from engine.storage.model_dir import load_tokenizer
    from engine.training.preference_data import encode_preference_dataset
    from engine.training.reward_model import reward_micro_batches, split_eval

    tokenizer = load_tokenizer(model_dir)
    pairs = encode_preference_dataset(dataset, tokenizer, cfg.max_seq_len)
    train_idx, _ = split_eval(len(pairs), cfg.eval_fraction, 0)
    train = [pairs[i] for i in train_idx]
    indices = EpochSampler(len(train), 0, 0, 0).next_indices(cfg.global_batch_size)
    return tokenizer, reward_micro_batches([train[i] for i in indices], cfg, pad_token_id(tokenizer))


def rm_first_step_gradients(cfg, model_dir, dataset, log_metrics=None) -> dict:
    """On every rank (``run_stage``; also in a single process): the gradients of the rm stage's
    first step (:func:`rm_first_step_micro_batches`; this rank's share of them,
    ``accumulate_gradients`` with its data-parallel all-reduce), by parameter name with every
    expert at its global index, gathered from the ranks of the expert group (a collective)."""
    import re

    import torch.distributed as dist

    from engine.backends.megatron.reward_model import MegatronRewardTrainer
    from engine.distributed.collectives import expert_model_parallel_group
    from engine.distributed.share import micro_batch_share
    from engine.training.optimizer_step import accumulate_gradients
    from engine.training.reward_model import pair_loss

    trainer = MegatronRewardTrainer(model_dir, cfg, 0)
    _, micro = rm_first_step_micro_batches(cfg, model_dir, dataset)
    accumulate_gradients(trainer.model, micro_batch_share(micro, "rm"), pair_loss)
    group = expert_model_parallel_group()
    ep = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    mine = {}
    for name, p in trainer.model.named_parameters():
        local = re.match(r"(.*\.local_experts\.)(\d+)(\..*)", name)
        if local and ep > 1:  # local expert j of rank r is global expert r * (E / ep) + j
            per_rank = len(trainer.model.gpt.decoder.layers[0].mlp.experts.local_experts)
            name = f"{local[1]}{rank * per_rank + int(local[2])}{local[3]}"
        mine[name] = None if p.grad is None else p.grad.detach().clone()
    if ep == 1:
        return mine
    out: list = [None] * ep
    dist.all_gather_object(out, mine, group=group)
    return {k: v for part in out for k, v in part.items()}
