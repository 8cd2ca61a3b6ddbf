"""A policy's weights served for weight sync without a trainer (Ray workers import it by this
path; a test module's classes cannot be unpickled there)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.distributed.weight_source import HFBucketSource


class WeightSource(HFBucketSource):
    """A policy's weights served for weight sync, as the actor workers serve them
    (``HFBucketSource`` over a megatron-core model), without the optimizer: the model
    directory's weights replaced by random ones drawn from ``seed``."""

    def __init__(self, policy_dir: str, seed: int, bucket_bytes: int):
        from engine.storage.model_dir import load_model_dir

        loaded = load_model_dir(policy_dir)
        self.model, self.hf_config = loaded.model.eval(), loaded.hf_config
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.cfg = SimpleNamespace(engine=SimpleNamespace(weight_sync_bucket_mb=bucket_bytes / 2**20))

    def _bucket_weights(self):
        return self.model
