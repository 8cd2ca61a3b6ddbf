"""The library-internal deprecations are ignored, and only they."""

import warnings

from engine.library_warnings import LIBRARY_DEPRECATIONS, silence_library_deprecations


def test_only_the_listed_library_deprecations_are_ignored():
    seen = [  # the messages as the libraries word them (megatron-core, torch, vLLM)
        "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
        "Please use DTensor instead and we are deprecating ShardedTensor.",
        "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
    ]
    assert len(seen) == len(LIBRARY_DEPRECATIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_library_deprecations()
        silence_library_deprecations()  # idempotent
        for message in seen:
            warnings.warn(message, FutureWarning)
        warnings.warn("`load_state_dict` is deprecated and will be removed in future versions.", UserWarning)
        warnings.warn("posttrain's own key is deprecated", FutureWarning)
    assert [(w.category, str(w.message)) for w in caught] == [
        (UserWarning, "`load_state_dict` is deprecated and will be removed in future versions."),
        (FutureWarning, "posttrain's own key is deprecated"),
    ]
