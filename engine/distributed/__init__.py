"""Data and tensor parallelism of the training roles: the collectives the optimizer step
uses (:mod:`engine.distributed.collectives`) and the Ray actor groups that run a role as
``data_parallel_size x tensor_model_parallel_size`` ranks (:mod:`engine.distributed.group`);
the Ray cluster connection (:mod:`engine.distributed.cluster`); a rank's share of a step's
micro-batches (:mod:`engine.distributed.share`) and the driver side of the data-parallel sft
and rm stages (:mod:`engine.distributed.stage_group`)."""
