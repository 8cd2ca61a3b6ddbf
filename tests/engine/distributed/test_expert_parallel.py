"""Expert parallelism (sft.parallel.expert_model_parallel_size): the layouts the config refuses.
(An SFT run at DP=2 x EP=2 gives the DP=1 loss but a gradient norm 1.5e-5 apart, relative: not
yet equal; docs/conversion.md, Expert parallelism.)"""

from __future__ import annotations

import pytest
from config.parallel import ParallelConfig


def test_config_refuses_expert_parallel_sizes_that_do_not_divide_the_data_parallel_ranks():
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 must divide data_parallel_size=3"):
        ParallelConfig(data_parallel_size=3, expert_model_parallel_size=2)
