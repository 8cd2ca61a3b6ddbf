"""Silence the deprecation warnings that libraries raise about their own internal calls.

megatron-core's torch_dist checkpointing calls torch APIs that torch deprecates, and vLLM's
kernel dispatcher touches a deprecated ``torch.distributed`` attribute. Each warning names a
line inside a library that a user of this project cannot change, and it prints on every
stage. Only these exact messages are ignored, so a deprecation in this project's own calls,
or any other warning, still shows.
"""

from __future__ import annotations

import warnings

# (category, start of the message), each seen on a stage's console.
LIBRARY_DEPRECATIONS: tuple[tuple[type[Warning], str], ...] = (
    # megatron/core/dist_checkpointing/strategies/torch.py calls checkpoint.load_state_dict
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed in future versions"),
    # torch/distributed/checkpoint planners, on the ShardedTensors megatron's torch_dist builds
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    # vllm/triton_utils/dispatcher.py scans torch.distributed's attributes, reduce_op among them
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated"),
)


def silence_library_deprecations() -> None:
    """Ignore the warnings of :data:`LIBRARY_DEPRECATIONS` in this process (idempotent:
    ``warnings.filterwarnings`` replaces an identical filter)."""
    for category, message in LIBRARY_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=category)
