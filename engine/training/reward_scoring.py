"""RL-time scoring with a trained reward model: load it from its model directory and score
prompt + response token ids."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.batching.collate import collate_tokens, pad_token_id, split_micro_batches
from engine.models.expert_lockstep import lockstep_passes
from engine.models.heads import HEAD_BIAS, HEAD_WEIGHT, RewardModel
from engine.models.master_weights import compute_dtype
from engine.storage.model_dir import load_model_dir
from engine.training.preference_data import encode_response


def load_reward_model(model_dir: str | Path, precision: str | None = None) -> RewardModel:
    """A trained reward model (eval mode, frozen: no gradients, no master weights) from a model
    directory with a reward head.

    Args:
        model_dir: a reward model's directory (``heads.safetensors`` with the reward head).
        precision: compute precision (``"bf16"``: body and head cast to bfloat16 from the stored
            fp32 weights; ``"fp32"``; None/``"auto"`` resolved by
            :func:`config.precision.resolve_precision`). The scores are fp32 either way
            (:func:`engine.models.heads.last_token_scores` upcasts).

    Raises:
        ValueError: naming the directory, when ``heads.safetensors`` lacks
            ``reward_head.weight`` / ``reward_head.bias`` or their shapes do not match.
    """
    dtype = compute_dtype(precision)
    loaded = load_model_dir(model_dir, dtype=dtype)
    missing = {HEAD_WEIGHT, HEAD_BIAS} - loaded.heads.keys()
    if missing:
        raise ValueError(f"{model_dir}: heads.safetensors lacks {sorted(missing)}; not a reward model directory")
    model = RewardModel(loaded.model, loaded.spec.hidden_size)
    try:
        model.reward_head.load_state_dict({"weight": loaded.heads[HEAD_WEIGHT], "bias": loaded.heads[HEAD_BIAS]})
    except RuntimeError as e:
        raise ValueError(f"{model_dir}: reward head does not fit hidden size {loaded.spec.hidden_size}: {e}") from e
    model.to(dtype)  # the head (built fp32, loaded from the fp32 heads file) as the body
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def score(
    model: RewardModel,
    tokenizer,
    prompts: Sequence[Any],
    responses: Sequence[str],
    max_len: int | None = None,
    micro_batch_size: int = 16,
) -> torch.Tensor:
    """Rewards of (prompt, response) pairs, encoded exactly as in training.

    Args:
        model: from :func:`load_reward_model`.
        tokenizer: the model directory's tokenizer (engine.storage.model_dir.load_tokenizer).
        prompts: N prompts, each a list of ``{"role", "content"}`` messages or a user string.
        responses: N assistant responses (text).
        max_len: cut each conversation to this many tokens (None: no cut).
        micro_batch_size: conversations per forward pass.

    Under expert parallelism (the RL reward model at ``rl.parallel.reward_model.expert_model_parallel_size``
    > 1) a collective of the expert group: every rank runs as many forwards of as many tokens
    (``engine.models.expert_lockstep``), so every rank of the group must call it, with ``N >= 1``.

    Returns:
        FloatTensor ``[N]`` of rewards.

    Raises:
        ValueError: if ``prompts`` and ``responses`` differ in length.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"score: {len(prompts)} prompts but {len(responses)} responses")
    if len(prompts) == 0:
        return torch.zeros(0)
    was_training = model.training
    model.eval()
    seqs = [encode_response(tokenizer, p, r, max_len)[0] for p, r in zip(prompts, responses)]
    out = []
    # expert parallelism: as many forwards as the expert group's other ranks (padding ones discarded)
    for chunk, real in lockstep_passes(split_micro_batches(seqs, micro_batch_size)):
        batch = collate_tokens(chunk, None, pad_token_id(tokenizer))
        rewards = model(batch.input_ids, batch.lengths)
        if real:
            out.append(rewards)
    model.train(was_training)
    return torch.cat(out)
