"""The reward model on the DeepSpeed backend (``rm.backend: deepspeed``).

:class:`DeepSpeedRewardTrainer` is the ``engine.training.reward_contract.RewardTrainer`` that
``engine.training.reward_model.train_reward_model`` runs when ``rm.backend`` is ``deepspeed``: the
same data, batches, Bradley-Terry loss, schedule and evaluation as the megatron backend, but
the weights are the HF transformers form of the base model (``engine.storage.hf_io.load_hf_causal_lm``)
with the same reward head (:class:`HFRewardModel`), trained by an
``engine.backends.deepspeed.runtime.DeepSpeedTrainer`` at ZeRO stage ``rm.deepspeed.zero_stage``.

At the end it writes the model directory the megatron backend writes: the body's weights
converted back to megatron names and vocabulary padding (``conversion.registry.hf_to_megatron``)
in a torch_dist checkpoint (``engine.storage.model_dir.save_model_dir``), with the reward head in
``heads.safetensors``. ``engine.training.reward_scoring.load_reward_model``, ``score`` and the RL
reward worker read it unchanged. Its resumable train state is the
``engine.backends.deepspeed.runtime.DeepSpeedTrainer`` one (weights by module name, the AdamW state
DeepSpeed steps, schedule, data position, RNG), tagged with the ZeRO stage it depends on.

Shapes: ``B`` sequences, ``T`` positions, ``H`` hidden size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from config.schema import RMConfig
from conversion.registry import hf_to_megatron
from engine.backends.deepspeed.runtime import (
    DeepSpeedTrainer,
    import_deepspeed,
    init_process_group,
)
from engine.batching.collate import TokenBatch
from engine.distributed.collectives import sum_across_ranks
from engine.models.heads import BODY_PREFIX, HFRewardModel
from engine.models.megatron import build_gpt_model, load_mcore_state
from engine.storage.hf_io import load_hf_causal_lm
from engine.storage.model_dir import save_model_dir
from engine.storage.train_state import DataPosition, TrainState
from engine.training.reward_model import pair_loss

# train_state.pt's ``extra`` key recording which backend (and ZeRO stage) wrote a reward-model state.
RM_TAG_KEY = "rm_backend"


class DeepSpeedRewardTrainer:
    """``rm.backend: deepspeed``: an :class:`HFRewardModel` trained through DeepSpeed
    (the ``engine.training.reward_contract.RewardTrainer`` protocol).

    Args:
        base_model_dir: model directory to start from.
        cfg: the ``rm`` config (``optim``, ``steps``, ``micro_batch_size``, ``deepspeed``,
            ``precision``: under bf16 the body and head compute in bf16 and the optimizer steps
            fp32 masters, ``engine.backends.deepspeed.runtime``).
        seed: model-building and reward-head seed.

    Attributes:
        model: the DeepSpeed engine; ``model(input_ids, lengths)`` gives rewards ``[B]``.
        collective_forward: every forward is a collective of the data-parallel ranks (ZeRO-3
            at DP > 1), so every rank runs the held-out evaluation.

    At ``rm.parallel.data_parallel_size > 1`` each rank runs this trainer in its
    ``engine.distributed.group.RankActor`` and ZeRO partitions over the ranks
    (``engine.backends.deepspeed.runtime``); :meth:`step` takes the rank's share of the
    micro-batches and normalises by the whole batch's pairs.

    Raises:
        RuntimeError: see ``engine.backends.deepspeed.runtime.import_deepspeed`` and
            ``init_process_group``.
        FileNotFoundError / ValueError: from ``engine.storage.hf_io.load_hf_causal_lm``.
    """

    def __init__(self, base_model_dir: str | Path, cfg: RMConfig, seed: int = 0):
        import_deepspeed()
        init_process_group()
        loaded = load_hf_causal_lm(base_model_dir, seed=seed)
        self.spec, self.hf_config, self.tokenizer_dir, self.seed = (
            loaded.spec,
            loaded.hf_config,
            loaded.tokenizer_dir,
            seed,
        )
        causal_lm = loaded.model
        self.body_prefix = f"{causal_lm.base_model_prefix}."
        # Weights outside the body (an untied output layer, e.g. lm_head.weight): not trained,
        # as in the megatron reward model, and written back unchanged. A tied output layer is
        # the embedding, which named_parameters lists once, under the body.
        self.untrained = {
            name: p.detach().clone()
            for name, p in causal_lm.named_parameters()
            if not name.startswith(self.body_prefix)
        }
        module = HFRewardModel(causal_lm, self.spec.hidden_size, seed)
        self.trainer = DeepSpeedTrainer(
            module, cfg.optim, cfg.steps, cfg.deepspeed, cfg.micro_batch_size, cfg.precision
        )
        self.model = self.trainer.engine
        # ZeRO-3 at DP > 1: a forward gathers parameters from every rank, so all ranks evaluate
        self.collective_forward = self.trainer.collective_forward

    def step(self, micro: list[TokenBatch]) -> dict[str, float]:
        """One optimizer step on :func:`engine.training.preference_data.collate_pairs` micro-batches: each
        micro-batch's summed Bradley-Terry loss (:func:`engine.training.reward_model.pair_loss`) divided
        by the pairs of the whole batch, so the gradient is the batch mean's, as the megatron
        backend's ``train_step`` divides after accumulating.

        Returns: ``{"loss" (mean over the batch's pairs, nats), "accuracy", "margin",
            "grad_norm" (before clipping), "lr", "num_units" (pairs)}``.

        Raises:
            ValueError: no micro-batches.
            FloatingPointError: a non-finite gradient norm.
        """
        # the whole batch's pairs: at DP > 1 ``micro`` is this rank's share (engine.distributed.share)
        total = int(sum_across_ranks({"pairs": sum(batch.input_ids.size(0) // 2 for batch in micro)})["pairs"])

        def loss_fn(model, batch: TokenBatch):
            loss_sum, pairs, metrics = pair_loss(model, batch)
            return loss_sum / total, pairs, metrics

        return self.trainer.train_step(micro, loss_fn)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The model's HF-named weights without the reward head (copies under ZeRO-3, else
        the live tensors): the body under the causal LM's names, plus the untrained ones.
        Under bf16 the fp32 masters (``DeepSpeedTrainer.named_tensors(full_precision=True)``),
        as the model directory keeps them."""
        state = dict(self.untrained)
        for name, tensor in self.trainer.named_tensors(full_precision=True):
            if name.startswith(BODY_PREFIX):
                state[self.body_prefix + name[len(BODY_PREFIX) :]] = tensor
        return state

    def heads(self) -> dict[str, torch.Tensor]:
        """``reward_head.weight`` ``[1, H]`` and ``reward_head.bias`` ``[1]`` (copies), the names
        ``engine.training.reward_scoring.load_reward_model`` reads from ``heads.safetensors``; fp32
        masters under bf16, as :meth:`hf_state`."""
        return {
            name: tensor.clone()
            for name, tensor in self.trainer.named_tensors(full_precision=True)
            if name.startswith("reward_head.")
        }

    def save_state(self, directory: str | Path, step: int, data_position: DataPosition, extra: dict[str, Any]) -> None:
        """``engine.training.reward_contract.RewardTrainer.save_state``: ``directory/train_state.pt`` with the
        :class:`HFRewardModel`'s ``body.*`` and ``reward_head.*`` tensors, the AdamW state as
        DeepSpeed steps it (under ZeRO: over its flat fp32 partitions), the schedule, RNG states,
        ``data_position`` and ``extra`` (``engine.backends.deepspeed.runtime.DeepSpeedTrainer.save_state``)."""
        self.trainer.save_state(directory, RM_TAG_KEY, step, data_position, extra)

    def load_state(self, directory: str | Path) -> TrainState:
        """``engine.training.reward_contract.RewardTrainer.load_state``: restore a state :meth:`save_state`
        wrote at the same ZeRO stage; returns it (its ``extra`` without the backend tag).

        Raises:
            FileNotFoundError / ValueError: from ``engine.storage.train_state.load_train_state``.
            ValueError: the state was written by the megatron backend or at another ZeRO stage
                (names ``rm.backend`` and ``rm.deepspeed.zero_stage``).
        """
        return self.trainer.load_state(directory, RM_TAG_KEY, "rm.backend and rm.deepspeed.zero_stage")

    def save(self, out_dir: str | Path, iteration: int) -> Path:
        """Write the reward model as a model directory, atomically: :meth:`hf_state` through
        ``conversion.registry.hf_to_megatron`` (vocabulary padded to the base model's
        ``padded_vocab_size`` with zero rows) into a megatron-core GPTModel, saved by
        ``engine.storage.model_dir.save_model_dir`` with :meth:`heads` in ``heads.safetensors``.

        Returns: ``Path(out_dir)``.

        Raises:
            conversion.registry.ConversionError: a tensor is missing, unexpected or misshapen.
        """
        mcore = hf_to_megatron(self.hf_config, self.hf_state(), padded_vocab_size=self.spec.padded_vocab_size)
        gpt = build_gpt_model(self.spec, seed=self.seed)
        load_mcore_state(gpt, mcore)
        return save_model_dir(out_dir, gpt, self.hf_config, self.tokenizer_dir, iteration=iteration, heads=self.heads())
