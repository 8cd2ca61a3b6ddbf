"""The megatron-core reward-model trainer: a GPTModel body with a reward head, trained on
preference pairs by :func:`engine.training.reward_model.train_reward_model`."""

from __future__ import annotations

from pathlib import Path

from config.schema import RMConfig
from engine.batching.collate import TokenBatch
from engine.models.heads import RewardModel
from engine.models.master_weights import full_precision_weights
from engine.storage.model_dir import load_model_dir, save_model_dir
from engine.training.model_trainer import ModelTrainer
from engine.training.optimizer_step import build_model_optimizer
from engine.training.reward_model import pair_loss


class MegatronRewardTrainer(ModelTrainer):
    """``rm.backend: megatron``: a :class:`RewardModel` on the base model's GPTModel, trained by
    :func:`engine.training.optimizer_step.train_step` with AdamW + warmup/cosine over ``cfg.steps``
    on :func:`engine.training.reward_model.pair_loss` (the :class:`ModelTrainer`'s ``step``,
    ``save_state`` and ``load_state``: the :class:`RewardModel`'s ``gpt.*`` and ``reward_head.*``
    tensors, AdamW and the schedule, as a sharded train state that resumes at any layout).

    Under ``cfg.precision`` bf16 (None/auto resolved by :func:`config.precision.resolve_precision`)
    the body and the reward head compute in bf16 and AdamW steps their fp32 masters
    (:func:`engine.training.optimizer_step.build_model_optimizer` on the whole
    :class:`RewardModel`); the model directory and the train state hold the fp32 masters.

    Raises: FileNotFoundError / ValueError from ``engine.storage.model_dir.load_model_dir``.
    """

    def __init__(self, base_model_dir: str | Path, cfg: RMConfig, seed: int = 0):
        self.loaded = load_model_dir(base_model_dir, seed=seed)
        model = RewardModel(self.loaded.model, self.loaded.spec.hidden_size, seed=seed)
        optimizer, scheduler = build_model_optimizer(model, cfg.optim, cfg.steps, cfg.precision)
        super().__init__(model, optimizer, scheduler, pair_loss, cfg.optim.grad_clip)

    def step(self, micro: list[TokenBatch]) -> dict[str, float]:
        """:meth:`engine.training.reward_contract.RewardTrainer.step` (:meth:`ModelTrainer.step` on
        :func:`engine.training.reward_model.pair_loss`)."""
        return super().step(micro)

    def save(self, out_dir: str | Path, iteration: int) -> Path:
        """Write the trained reward model as a model directory (body as torch_dist, head in
        ``heads.safetensors``), fp32 under bf16 too: the masters belong to the whole
        :class:`RewardModel`, so they are put in place around it, body and head alike."""
        model = self.model
        assert isinstance(model, RewardModel)  # built in __init__
        with full_precision_weights(model):
            return save_model_dir(
                out_dir,
                model.gpt,
                self.loaded.hf_config,
                self.loaded.tokenizer_dir,
                iteration=iteration,
                heads=model.heads(),
            )
