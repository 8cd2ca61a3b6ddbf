"""`posttrain validate` (a real subprocess) on layouts: the memory plan of the rl stage, the
refusal of a rank that cannot fit its device, and the notes on what the nodes of a Ray
cluster the engine joins must share (the other refusals: tests/config/test_memory_plan.py).

Qwen2.5-0.5B's real config.json (a stand-in weights file) with the real Qwen2.5 tokenizer and GSM8K
prompts (the longest rl_train prompt: 223 tokens, tests/flows/test_preflight.py)."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import yaml

from tests.flows.model_dirs import write_stand_in_weights
from tests.flows.test_cli_validate import _out, _posttrain
from tests.flows.test_preflight import QWEN_CONFIG

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

GIB = 2**30


def _config(tmp_path, fixtures_dir, model: dict, **rl) -> str:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(model))
    write_stand_in_weights(model_dir, model["hidden_size"])
    gsm8k = fixtures_dir / "gsm8k"
    raw = {
        "run": {
            "name": "layouts",
            "artifact_root": str(tmp_path / "artifacts"),
            "checkpoint_root": str(tmp_path / "checkpoints"),
            "precision": "fp32",
            "device_memory_gib": 8,
        },
        "data": {
            "rl_train": {"path": str(gsm8k / "train_first2000.jsonl"), "format": "gsm8k"},
            "rl_eval": {"path": str(gsm8k / "test.jsonl"), "format": "gsm8k", "limit": 50},
        },
        "model": {"source": str(model_dir), "tokenizer": str(fixtures_dir / "qwen2.5-tokenizer")},
        "sft": {"enabled": False},
        "rm": {"enabled": False},
        "rl": {"reward": {"verifier": "gsm8k"}, "micro_batch_size": 4, "engine": {"num_cpus": 2}, **rl},
    }
    path = tmp_path / "layouts.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def test_validate_refuses_an_actor_rank_larger_than_its_gpu(tmp_path, fixtures_dir, monkeypatch):
    """An fp32 actor of Qwen2.5-0.5B on one 8 GiB GPU per rank: 16 bytes per parameter plus one
    micro-batch's activations exceed it. On a cluster the engine joins (RAY_ADDRESS), validate
    notes what the nodes must share and checks nothing of this machine's CPUs or memory."""
    cfg = _config(tmp_path, fixtures_dir, QWEN_CONFIG, parallel={"actor": {"gpus_per_rank": 1}})
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    proc = _posttrain("validate", cfg)
    out = _out(proc)
    assert proc.returncode == 1, out
    # by hand: P = 494,032,768 (151,936 rows, a multiple of 128); s = 223 + 32 tokens, b = 4
    p, s, b, h, a, v = 494_032_768, 255, 4, 896, 14, 151_936
    act = math.ceil(Fraction(s * b * h) * (34 + Fraction(5 * a * s, h)) * 24 * 2) + 8 * s * b * v
    total = 16 * p + act
    parts = f"weights {4 * p / GIB:.2f}, gradients {4 * p / GIB:.2f}, optimizer {8 * p / GIB:.2f}, activations {act / GIB:.2f}"
    assert (
        f"rl.parallel.actor: a rank needs about {total / GIB:.2f} GiB (actor 1 x {total / GIB:.2f} GiB ({parts})) but "
        "has 8.00 GiB (rl.parallel.actor.gpus_per_rank 1 x run.device_memory_gib 8); raise rl.parallel.actor."
        "tensor_model_parallel_size or gpus_per_rank, or lower the micro-batch (estimates: docs/scaling.md)"
    ) in out
    assert f"config {cfg} has 1 problem(s):" in out
    assert (
        f"note: memory plan (rl, sequences of 255 tokens): actor 1 x {total / GIB:.2f} GiB ({parts}); rollout 1 x "
        in out
    )
    assert (
        "note: RAY_ADDRESS: the rl stage (and sft, rm, po with data_parallel_size > 1) joins the Ray cluster at "
        "10.0.0.1:6379; this process is its driver"
    ) in out
    assert (
        f"note: run.artifact_root: {tmp_path / 'artifacts'} is a local path: on a Ray cluster of several nodes every "
        "node must see it at the same path"
    ) in out
    assert "or use an object store URL such as s3://bucket/prefix (docs/concepts.md, Object stores)" in out
    assert f"note: run.checkpoint_root: {tmp_path / 'checkpoints'}: the workers write" in out
    assert "Traceback" not in out


def test_validate_places_the_rl_bundles_on_the_declared_nodes(tmp_path, fixtures_dir, monkeypatch):
    """docs/scaling.md's two 8-GPU nodes (rl.engine.cluster_nodes) on a cluster validate does
    not connect to: an actor of 16 ranks x 1 GPU with 16 engines of 1 GPU. Colocated they share
    16 devices (the placement note lists 16 bundles of 8 CPUs and 1 GPU); disaggregated they
    need 32 GPUs and validate names the placement key."""
    nodes = [{"cpus": 64, "gpus": 8}, {"cpus": 64, "gpus": 8}]
    layout = dict(
        parallel={"actor": {"data_parallel_size": 16, "gpus_per_rank": 1}},
        rollout={"num_engines": 16, "gpus_per_engine": 1},
    )
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cfg = _config(
        tmp_path,
        fixtures_dir,
        QWEN_CONFIG,
        micro_batch_size=1,
        prompts_per_step=16,
        **layout,
        engine={"num_cpus": 128, "cluster_nodes": nodes, "placement": "disaggregated", "rollout_cpus": 16},
    )
    raw = yaml.safe_load(open(cfg))
    raw["run"]["device_memory_gib"] = 141
    open(cfg, "w").write(yaml.safe_dump(raw, sort_keys=False))
    out = _out(_posttrain("validate", cfg))
    assert (
        "rl.engine.placement: disaggregated: the run's 32 bundles (128 CPUs, 32 GPUs) do not fit the cluster's "
        "nodes (64 CPUs + 8 GPUs, 64 CPUs + 8 GPUs) together; lower rl.engine.num_cpus, the ranks or the engines, "
        "or add nodes"
    ) in out
    out = _out(_posttrain("validate", cfg, "rl.engine.placement=colocated"))
    assert "note: placement (colocated, PACK): bundle 0 = 8 CPUs + 1 GPUs (actor 0, rollout 0); " in out
    assert "bundle 15 = 8 CPUs + 1 GPUs (actor 15, rollout 15)" in out and "placement: disaggregated" not in out
