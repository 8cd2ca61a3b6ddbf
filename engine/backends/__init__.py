"""What trains the weights: :mod:`engine.backends.select` maps ``rl.backend`` and
:mod:`engine.backends.select_rm` maps ``rm.backend`` to the megatron-core or DeepSpeed
classes. Re-exports nothing."""
