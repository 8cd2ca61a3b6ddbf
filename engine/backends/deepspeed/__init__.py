"""The DeepSpeed backend: runtime plus its actor, critic and reward-model trainers (the only
importer of ``deepspeed``). Re-exports nothing."""
