"""What trains the weights: :mod:`engine.backends.select` maps ``rl.backend`` /
``rm.backend`` to the megatron-core or DeepSpeed classes. Re-exports nothing."""
