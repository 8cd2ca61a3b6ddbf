"""Bucketed weight sync (engine.models.weight_buckets) against the whole-model stream it replaces:
same tensors in the same order, buckets within budget, no aliasing of the live model, and a
rollout engine updated bucket by bucket ending with exactly the weights of a full update."""

from __future__ import annotations

import pytest
import torch

from config.rl import EngineConfig, RLConfig
from conversion.export import write_hf_safetensors
from conversion.registry import megatron_to_hf
from conversion.spec import GPTSpec
from engine.models.megatron import build_gpt_model, gpt_logits, mcore_state
from engine.models.weight_buckets import BucketServer, hf_bucket, iter_buckets, load_group, plan_buckets, plan_policy
from engine.rollout.hf_rollout import HFRollout

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

# qwen2: tied embeddings and QKV biases; llama: untied output layer, no biases.
ARCHS = {"qwen2": ("Qwen2ForCausalLM", True), "llama": ("LlamaForCausalLM", False)}
# Tensor sizes of the tiny model (fp32): q 16 KiB, k/v 8 KiB, o_proj 16 KiB, down 32 KiB,
# gate+up 64 KiB, embedding 24 KiB. 40 000 bytes packs several tensors per bucket, and the
# fused gate/up pair (one vLLM module) exceeds it and must travel alone.
SMALL_BUDGET = 40_000
IDS = torch.tensor([[3, 17, 42, 5, 88, 1, 60, 9], [70, 71, 2, 2, 40, 33, 12, 95]])


def hf_config(arch: str, intermediate_size: int = 128) -> dict:
    name, tied = ARCHS[arch]
    return {
        "architectures": [name],
        "model_type": arch,
        "vocab_size": 96,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "eos_token_id": 1,
        "pad_token_id": 0,
    }


def policy(cfg: dict, seed: int):
    """A megatron-core model with every parameter random (biases and norms included)."""
    model = build_gpt_model(GPTSpec.from_hf_config(cfg), seed=seed).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def setup(request):
    cfg = hf_config(request.param)
    return cfg, policy(cfg, seed=1)


def full_stream(cfg, model) -> list[tuple[str, torch.Tensor]]:
    return [(name, t.detach().clone()) for name, t in megatron_to_hf(cfg, mcore_state(model))]


def assert_same_stream(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


# ----------------------------------------------------------------------------- planning


def test_load_groups_follow_vllm_modules():
    assert load_group("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.qkv_proj"
    assert load_group("model.layers.3.self_attn.v_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert load_group("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj"
    assert load_group("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj"
    assert load_group("model.layers.0.self_attn.o_proj.bias") == "model.layers.0.self_attn.o_proj"
    assert load_group("lm_head.weight") == "lm_head"
    assert load_group("scale") == "scale"


def test_plan_packs_greedily_and_isolates_oversized_tensors():
    f32 = torch.float32
    stream = [
        ("a.weight", (10,), f32),
        ("b.weight", (10,), f32),
        ("big.weight", (100,), f32),
        ("c.weight", (5,), f32),
        ("d.weight", (20,), torch.bfloat16),
        ("e.weight", (3,), f32),
    ]
    plan = plan_buckets(stream, bucket_bytes=80)
    assert [[t.name for t in plan.bucket(i)] for i in range(plan.num_buckets)] == [
        ["a.weight", "b.weight"],
        ["big.weight"],
        ["c.weight", "d.weight", "e.weight"],
    ]
    assert [plan.bucket_nbytes(i) for i in range(plan.num_buckets)] == [80, 400, 72]
    assert plan.total_bytes == 552 and plan.tensors[3].nbytes == 20
    with pytest.raises(IndexError, match="3 buckets"):
        plan.bucket(3)


def test_plan_never_splits_a_module_even_when_its_tensors_are_apart():
    f32 = torch.float32
    # o_proj's weight and bias are not adjacent (Qwen3's map streams the bias last in the
    # layer): everything between them has to stay in their bucket.
    stream = [
        ("l.self_attn.o_proj.weight", (16,), f32),
        ("l.norm.weight", (16,), f32),
        ("l.mlp.down_proj.weight", (16,), f32),
        ("l.self_attn.o_proj.bias", (4,), f32),
        ("l.self_attn.q_proj.weight", (16,), f32),
        ("l.self_attn.k_proj.weight", (16,), f32),
        ("l.self_attn.v_proj.weight", (16,), f32),
        ("l.mlp.gate_proj.weight", (8,), f32),
        ("l.mlp.up_proj.weight", (8,), f32),
    ]
    plan = plan_buckets(stream, bucket_bytes=64)
    assert [[t.name.split(".", 1)[1] for t in plan.bucket(i)] for i in range(plan.num_buckets)] == [
        ["self_attn.o_proj.weight", "norm.weight", "mlp.down_proj.weight", "self_attn.o_proj.bias"],
        ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    ]


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        plan_buckets([("a", (1,), torch.float32)], 0)
    with pytest.raises(ValueError, match="'a' occurs twice"):
        plan_buckets([("a", (1,), torch.float32), ("a", (1,), torch.float32)], 10)
    empty = plan_buckets([], 10)
    assert empty.num_buckets == 0 and empty.starts == (0,)


@pytest.mark.parametrize("budget", [1, SMALL_BUDGET, 1 << 30])
def test_concatenated_buckets_equal_megatron_to_hf(setup, budget):
    cfg, model = setup
    plan = plan_policy(cfg, model, budget)
    buckets = list(iter_buckets(cfg, model, plan))
    assert len(buckets) == plan.num_buckets
    assert_same_stream([pair for bucket in buckets for pair in bucket], full_stream(cfg, model))
    if budget == 1 << 30:
        assert plan.num_buckets == 1
    # Each bucket by index, alone, is the same bucket.
    for i in (0, plan.num_buckets - 1):
        assert_same_stream(hf_bucket(cfg, model, plan, i), buckets[i])


def test_buckets_respect_the_budget_and_keep_modules_whole(setup):
    cfg, model = setup
    plan = plan_policy(cfg, model, SMALL_BUDGET)
    buckets = list(iter_buckets(cfg, model, plan))
    assert plan.num_buckets >= 4
    groups_seen: dict[str, int] = {}
    oversized = 0
    for i, bucket in enumerate(buckets):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size == plan.bucket_nbytes(i)
        groups = [load_group(name) for name, _ in bucket]
        if size > SMALL_BUDGET:  # only a single module that alone exceeds the budget
            assert len(set(groups)) == 1, (i, groups)
            oversized += 1
        for g in groups:
            assert groups_seen.setdefault(g, i) == i, f"module {g} split across buckets"
        if i + 1 < len(buckets):  # greedy: the next bucket's first module did not fit
            first = load_group(buckets[i + 1][0][0])
            head = sum(t.numel() * t.element_size() for n, t in buckets[i + 1] if load_group(n) == first)
            assert size + head > SMALL_BUDGET
    assert oversized == cfg["num_hidden_layers"]  # the fused gate/up of each layer


def test_bucket_tensors_do_not_alias_the_model(setup):
    cfg, _ = setup
    model = policy(cfg, seed=5)
    plan = plan_policy(cfg, model, SMALL_BUDGET)
    taken = list(iter_buckets(cfg, model, plan)) + [hf_bucket(cfg, model, plan, 0)]
    saved = [[(n, t.clone()) for n, t in bucket] for bucket in taken]
    model_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for bucket in taken:
        for name, t in bucket:
            assert t.is_contiguous() and t.untyped_storage().data_ptr() not in model_ptrs, name
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for bucket, before in zip(taken, saved):
        assert_same_stream(bucket, before)


def test_stream_that_does_not_match_the_plan_is_an_error(setup):
    cfg, model = setup
    name = cfg["architectures"][0].removesuffix("ForCausalLM").lower()
    other_cfg = hf_config(name, intermediate_size=96)
    other = policy(other_cfg, seed=2)
    plan = plan_policy(cfg, model, SMALL_BUDGET)
    with pytest.raises(ValueError, match=r"does not match the bucket plan at tensor \d+: expected .*down_proj"):
        list(iter_buckets(other_cfg, other, plan))
    with pytest.raises(IndexError, match="out of range"):
        hf_bucket(cfg, model, plan, plan.num_buckets)
    with pytest.raises(IndexError, match="out of range"):
        iter_buckets(cfg, model, plan, start=-1)


def test_bucket_server_serves_in_order_and_out_of_order(setup):
    cfg, _ = setup
    model = policy(cfg, seed=6)
    server = BucketServer(cfg, model, SMALL_BUDGET)
    n = server.plan.num_buckets
    in_order = [server.bucket(i) for i in range(n)]
    assert_same_stream([p for b in in_order for p in b], full_stream(cfg, model))
    assert_same_stream(server.bucket(2), in_order[2])  # out of sequence: a fresh pass
    assert_same_stream(server.bucket(1), in_order[1])
    with torch.no_grad():  # training between syncs: the next sync starts from bucket 0 afresh
        for p in model.parameters():
            p.mul_(-1.0)
    again = [server.bucket(i) for i in range(n)]
    assert_same_stream([p for b in again for p in b], full_stream(cfg, model))
    with pytest.raises(IndexError):
        server.bucket(n)


# ----------------------------------------------------------------------------- rollout side


def hf_dir(cfg, model, path):
    return write_hf_safetensors(path, cfg, megatron_to_hf(cfg, mcore_state(model)), None)


@torch.no_grad()
def rollout_logits(engine: HFRollout) -> torch.Tensor:
    return engine.model(IDS).logits


def test_hf_rollout_updated_bucket_by_bucket_equals_a_full_update(setup, tmp_path):
    cfg, old = setup
    new = policy(cfg, seed=7)
    start = hf_dir(cfg, old, tmp_path / "old")
    full, bucketed = HFRollout(start), HFRollout(start)
    before = rollout_logits(full)

    full.update_weights(megatron_to_hf(cfg, mcore_state(new)))
    plan = plan_policy(cfg, new, SMALL_BUDGET)
    assert plan.num_buckets >= 4
    for i, bucket in enumerate(iter_buckets(cfg, new, plan)):
        bucketed.update_weights(bucket)
        if i == 0:  # a partial update leaves the other parameters as they were
            assert not torch.equal(rollout_logits(bucketed), rollout_logits(full))

    after = rollout_logits(bucketed)
    assert not torch.allclose(after, before)
    assert torch.equal(after, rollout_logits(full))
    assert full.model.state_dict().keys() == bucketed.model.state_dict().keys()
    for name, t in full.model.state_dict().items():
        assert torch.equal(bucketed.model.state_dict()[name], t), name
    # and the rollout now computes the policy's own logits
    with torch.no_grad():
        torch.testing.assert_close(after, gpt_logits(new, IDS), rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def actor_worker(tmp_path_factory, fixtures_dir):
    """ActorWorker in-process, from a model directory, with 1 MiB buckets. The Qwen2.5
    tokenizer's vocabulary makes the embedding ~19 MiB: over budget, a bucket of its own."""
    from engine.backends.megatron.actor import ActorWorker
    from engine.storage.model_dir import save_model_dir

    threads = torch.get_num_threads()
    cfg = {**hf_config("qwen2"), "vocab_size": 151665, "hidden_size": 32, "intermediate_size": 64}
    del cfg["eos_token_id"], cfg["pad_token_id"]
    root = tmp_path_factory.mktemp("actor")
    policy_dir = save_model_dir(root / "policy", policy(cfg, seed=3), cfg, fixtures_dir / "qwen2.5-tokenizer")
    yield ActorWorker(
        policy_dir, RLConfig(precision="fp32", engine=EngineConfig(weight_sync_bucket_mb=1)), num_threads=1
    )
    torch.set_num_threads(threads)


def test_actor_worker_serves_the_same_stream_in_buckets(actor_worker):
    plan = actor_worker.hf_bucket_plan()
    assert plan.bucket_bytes == 2**20 and plan.num_buckets == 2
    assert [t.name for t in plan.bucket(0)] == ["model.embed_tokens.weight"]
    buckets = [actor_worker.hf_bucket(i) for i in range(plan.num_buckets)]
    assert_same_stream([p for b in buckets for p in b], full_stream(actor_worker.hf_config, actor_worker.model))


class _Handle:
    """Stands in for a Ray actor handle: ``handle.method.remote(*args)`` calls the method."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        method = getattr(self.obj, name)
        return type("RemoteMethod", (), {"remote": staticmethod(method)})


def test_rl_update_weights_sends_every_bucket_in_order(actor_worker, monkeypatch):
    """engine.rl.phases.update_weights drives the actor and rollout workers bucket by bucket (Ray's
    ``get`` replaced by the identity: the handles here return values, not ObjectRefs)."""
    import engine.rl.phases as rl
    from engine.rl.workers import Workers

    received: list[list[str]] = []

    class Rollout:
        def update_weights(self, named_tensors):
            received.append([name for name, _ in named_tensors])

    monkeypatch.setattr(rl.ray, "get", lambda value, timeout=None: value)
    workers = Workers(
        placement=None, actor=_Handle(actor_worker), reference=None, rollout=_Handle(Rollout()), reward=None
    )
    seconds = rl.update_weights(workers)
    plan = actor_worker.hf_bucket_plan()
    assert seconds > 0 and len(received) == plan.num_buckets
    assert received == [[t.name for t in plan.bucket(i)] for i in range(plan.num_buckets)]


def test_hung_or_failing_sync_raises_within_the_timeout(tmp_path, fixtures_dir):
    """A real ActorWorker on Ray streams to rollout workers that hang or fail (test doubles:
    neither failure can be caused in a real engine on demand). The hung sync raises
    TimeoutError at the deadline instead of waiting; the failing one names its bucket."""
    import time

    import ray

    import engine.rl.phases as rl
    from engine.backends.megatron.actor import ActorWorker
    from engine.rl.placement import init_ray
    from engine.rl.workers import Workers
    from engine.storage.model_dir import save_model_dir

    class HangingRollout:
        def update_weights(self, named_tensors):
            time.sleep(120)

    class FailingRollout:
        def update_weights(self, named_tensors):
            raise KeyError(f"no parameter {named_tensors[0][0]!r} in the rollout model")

    cfg = hf_config("qwen2")
    policy_dir = save_model_dir(tmp_path / "policy", policy(cfg, seed=3), cfg, fixtures_dir / "qwen2.5-tokenizer")
    init_ray(num_cpus=2)  # left running for the next module (a cluster start saved); this test kills its actors
    started = []
    try:
        actor = ray.remote(ActorWorker).options(num_cpus=0).remote(str(policy_dir), RLConfig(precision="fp32"), 0, 1)
        started.append(actor)
        ray.get(actor.__ray_ready__.remote())
        hanging = ray.remote(HangingRollout).options(num_cpus=0, max_concurrency=2).remote()
        started.append(hanging)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match=r"bucket 1 of 1 not done within rl.engine.weight_sync_timeout_s=2.0 s"):
            rl.update_weights(Workers(None, actor, None, hanging, None), timeout_s=2.0)
        assert time.perf_counter() - t0 < 30  # the deadline, not the rollout's 120 s
        failing = ray.remote(FailingRollout).options(num_cpus=0).remote()
        started.append(failing)
        with pytest.raises(RuntimeError, match=r"bucket 1 of 1 failed: .*no parameter 'model.embed_tokens.weight'"):
            rl.update_weights(Workers(None, actor, None, failing, None), timeout_s=30.0)
    finally:
        for handle in started:  # the hanging one still sleeps in its call
            ray.kill(handle)
