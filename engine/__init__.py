"""Ray-hosted training and rollout engine (Megatron backend, vLLM rollout, RL algorithms)."""
