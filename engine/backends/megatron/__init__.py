"""The megatron-core backend: the RL actor, the PPO critic and the reward-model trainer, each a
megatron-core GPTModel stepped by :func:`engine.training.optimizer_step.train_step`.
Re-exports nothing."""
