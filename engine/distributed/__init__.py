"""Data and tensor parallelism of the training roles: the collectives the optimizer step
uses (:mod:`engine.distributed.collectives`) and the Ray actor groups that run a role as
``data_parallel_size x tensor_model_parallel_size`` ranks (:mod:`engine.distributed.group`)."""
