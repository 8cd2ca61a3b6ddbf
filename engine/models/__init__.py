"""Model bodies and forwards: megatron-core GPTModel, transformers causal LMs, scalar heads,
the CPU/GPU platform set-up and HF weight buckets. Re-exports nothing."""
