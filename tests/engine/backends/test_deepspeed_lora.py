"""LoRA on the DeepSpeed RL actor (rl.backend deepspeed, rl.lora; engine.models.hf_lora).

In process, no Ray, on test_deepspeed_backend.py's policy (a tiny Qwen2: hidden 64, 2 layers,
tied embeddings, SFT'd for a few seconds) with rank-4 adapters (alpha 8, scale 2) on all four
layer kinds: only the adapters train and hold AdamW state at every ZeRO stage; weight sync
sends the merged weights under the plain HF names; the published model holds the merged
weights and adapter/ the PEFT adapter; the train state holds the adapters alone and resumes
bit for bit; bf16 (the repository's masters at ZeRO-0, DeepSpeed's at ZeRO-2) trains the
adapters only.
"""

from __future__ import annotations

import json

import pytest
import torch

from config.lora import LoraConfig
from config.rl import RLConfig
from engine.models.hf import hf_logits
from engine.models.hf_lora import ADAPTER, is_adapter, lora_layers
from engine.storage.train_state import DataPosition, load_train_state
from tests.engine.backends.test_deepspeed_backend import batch, policy, rl_config, with_targets  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

STAGES = (0, 1, 2, 3)
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, save_adapter=True)
HF_TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def lora_worker(policy_dir, stage: int = 2, precision: str = "fp32"):
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker

    cfg = rl_config(
        stage=stage, deepspeed={"zero_stage": stage, "param_persistence_threshold": 0}, lora=LORA, precision=precision
    )
    return DeepSpeedActorWorker(policy_dir, cfg)


def update(worker, tokenizer, seed: int) -> dict[str, float]:
    """One actor update on :func:`batch` ``seed`` (advantages of both signs, a KL term)."""
    traj = batch(tokenizer, seed)
    return worker.update(with_targets(traj, worker.compute_logprobs(traj))).metrics


def all_tensors(worker, full_precision: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of the worker's module (adapters and base), whole, copied."""
    return {k: v.clone() for k, v in worker.trainer.named_tensors(full_precision)}


def independent_merge(worker) -> dict[str, torch.Tensor]:
    """``W + scale * B @ A`` of every adapted layer, from the PEFT modules' own tensors (fp32),
    under the layer's plain HF weight name."""
    with worker.trainer.gathered(worker.module.parameters()):
        return {
            f"{name}.weight": (
                m.base_layer.weight + m.scaling[ADAPTER] * m.lora_B[ADAPTER].weight @ m.lora_A[ADAPTER].weight
            )
            .detach()
            .clone()
            for name, m in lora_layers(worker.module).items()
        }


def test_config_accepts_lora_on_the_deepspeed_backend():
    cfg = RLConfig(backend="deepspeed", lora={"enabled": True}, deepspeed={"zero_stage": 3})
    assert cfg.lora.enabled and cfg.deepspeed.zero_stage == 3


@pytest.mark.parametrize("stage", STAGES)
def test_only_the_adapters_train(policy, stage):
    """fp32 at ZeRO stage ``stage``, two updates: the trainable parameters are exactly PEFT's
    lora_A / lora_B (8,192 elements: 2 layers x rank 4 x (in + out) of q, k, v, o, gate, up,
    down) against 92,224 base ones; every base tensor keeps its value bit for bit and has no
    gradient; every adapter tensor moves; AdamW holds exp_avg and exp_avg_sq of the adapters
    alone; validate's memory plan counts the same adapters."""
    from config.memory_estimates import ModelShape

    w = lora_worker(policy["dir"], stage)
    trained = [n for n, p in w.module.named_parameters() if p.requires_grad]
    before = all_tensors(w)
    assert trained == [n for n in before if is_adapter(n)] and len(trained) == 2 * 7 * 2
    n_adapter = sum(before[n].numel() for n in trained)
    n_base = sum(t.numel() for n, t in before.items() if n not in trained)
    assert (n_adapter, n_base) == (8_192, 92_224)
    # validate's memory plan counts them (PEFT: an A per projection; megatron's fused layers share one)
    shape = ModelShape.from_hf_config(w.hf_config)
    assert shape.lora_parameters(w.cfg.lora, per_projection=True) == n_adapter
    assert shape.lora_parameters(w.cfg.lora) == n_adapter - 2 * 4 * 64 * (2 + 1)
    print(f"ZeRO-{stage}: {n_adapter} adapter parameters, {n_base} base ({n_adapter / n_base:.1%})")

    metrics = [update(w, policy["tokenizer"], seed) for seed in (1, 2)]
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    after = all_tensors(w)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trained)
    assert all(not torch.equal(before[n], after[n]) for n in trained)
    assert all(p.grad is None for p in w.module.parameters() if not p.requires_grad)
    moments = [s for state in w.optimizer.state.values() for k, s in state.items() if k in ("exp_avg", "exp_avg_sq")]
    assert sum(m.numel() for m in moments) == 2 * n_adapter and {m.dtype for m in moments} == {torch.float32}


@pytest.mark.parametrize("stage", (2, 3))
def test_weight_sync_sends_the_merged_weights(policy, stage):
    """After two updates hf_tensors() is, name for name and in order, what a worker without
    LoRA yields: adapted weights equal W + 2 B A computed here from the PEFT modules (and
    PEFT's own get_delta_weight) within 1e-6, every other weight the base's exactly; the
    weight-sync bucket carries the same tensors; a plain transformers model loaded with them
    gives the LoRA model's logits within 1e-5."""
    from engine.backends.deepspeed.actor import DeepSpeedActorWorker
    from engine.models.hf import build_hf_causal_lm, load_hf_state

    plain = DeepSpeedActorWorker(policy["dir"], rl_config(stage=stage))
    base = {k: v.clone() for k, v in plain.hf_tensors()}
    w = lora_worker(policy["dir"], stage)
    for seed in (1, 2):
        update(w, policy["tokenizer"], seed)
    synced = [(k, v.clone()) for k, v in w.hf_tensors()]
    assert [k for k, _ in synced] == list(base)
    merged, expected = dict(synced), independent_merge(w)
    assert len(expected) == 14 and not any(s in k for k in merged for s in ("lora", "base_layer", "base_model"))
    worst = max(float((merged[k] - expected[k]).abs().max()) for k in expected)
    update_size = max(float((expected[k] - base[k]).abs().max()) for k in expected)
    print(
        f"ZeRO-{stage}: merged sync vs W + s B A: max |diff| {worst:.3g}; the update moved W by up to {update_size:.3g}"
    )
    assert worst <= 1e-6 and update_size > 1e-3
    with w.trainer.gathered(w.module.parameters()):
        peft_delta = {f"{n}.weight": m.get_delta_weight(ADAPTER) for n, m in lora_layers(w.module).items()}
        assert all((merged[k] - base[k] - peft_delta[k]).abs().max() <= 1e-6 for k in peft_delta)
    assert all(torch.equal(merged[k], base[k]) for k in base if k not in expected)
    bucket = dict(w.hf_bucket(0))
    assert w.hf_bucket_plan().num_buckets == 1 and bucket.keys() == merged.keys()
    assert all(torch.equal(bucket[k], merged[k]) for k in merged)

    model = build_hf_causal_lm(w.tokenizer_dir).eval()
    load_hf_state(model, w.spec, merged)
    ids = batch(policy["tokenizer"], 3).input_ids
    with torch.no_grad():
        w.engine.eval()
        err = float((hf_logits(model, ids) - hf_logits(w.engine, ids)).abs().max())
    print(
        f"ZeRO-{stage}: plain transformers model on the synced weights vs the LoRA model: logits max |diff| {err:.3g}"
    )
    assert err <= 1e-5


def test_save_model_writes_the_merged_model_and_the_peft_adapter(policy, tmp_path):
    """The model directory loads (load_model_dir) holding the synced merged weights exactly
    (fp32); adapter/ holds PEFT's adapter_config.json and adapter_model.safetensors with the
    megatron backend's names and shapes, and PeftModel.from_pretrained of it on the base
    policy gives the trained worker's logits within 1e-5."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from conversion.registry import megatron_to_hf
    from engine.backends.megatron.actor import ActorWorker
    from engine.models.lora import peft_adapter_state
    from engine.models.megatron import mcore_state
    from engine.storage.hf_io import load_hf_causal_lm
    from engine.storage.model_dir import load_model_dir

    w = lora_worker(policy["dir"])
    for seed in (1, 2):
        update(w, policy["tokenizer"], seed)
    out = tmp_path / "model"
    assert w.save_model(out, iteration=2) == str(out)
    loaded = load_model_dir(out)
    back, synced = dict(megatron_to_hf(loaded.hf_config, mcore_state(loaded.model))), dict(w.hf_tensors())
    assert back.keys() == synced.keys() and all(torch.equal(back[k], synced[k]) for k in synced)

    assert sorted(p.name for p in (out / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 8.0, "CAUSAL_LM")
    assert sorted(config["target_modules"]) == HF_TARGETS  # PEFT writes the set in any order
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    megatron = peft_adapter_state(ActorWorker(policy["dir"], rl_config("megatron", lora=LORA)).model)
    assert {k: v.shape for k, v in adapter.items()} == {k: v.shape for k, v in megatron.items()}
    assert len(adapter) == 28 and {v.dtype for v in adapter.values()} == {torch.float32}

    peft_model = PeftModel.from_pretrained(load_hf_causal_lm(policy["dir"]).model, str(out / "adapter")).eval()
    ids = batch(policy["tokenizer"], 3).input_ids
    with torch.no_grad():
        w.engine.eval()
        err = float((peft_model(input_ids=ids, use_cache=False).logits - hf_logits(w.engine, ids)).abs().max())
    print(f"PeftModel.from_pretrained(adapter/) vs the trained worker: logits max |diff| {err:.3g}")
    assert err <= 1e-5


@pytest.mark.parametrize("stage,precision", [(s, "fp32") for s in STAGES] + [(0, "bf16"), (2, "bf16")])
def test_resume_is_bit_identical_and_the_state_holds_the_adapters_only(policy, tmp_path, stage, precision):
    """Update, save_state, update in one worker; a fresh worker loads the state and takes the
    second update: the same log-probs, metrics, merged weights and adapters (under bf16 their
    fp32 masters), bit for bit. The state file's weights are the 28 adapter tensors (8,192
    fp32 elements) and no base weight."""
    a = lora_worker(policy["dir"], stage, precision)
    update(a, policy["tokenizer"], 1)
    a.save_state(tmp_path, 1, DataPosition(0, 6, 0), {"note": "kept"})
    second = batch(policy["tokenizer"], 2)
    old_a = a.compute_logprobs(second)
    metrics_a = a.update(with_targets(second, old_a)).metrics

    saved = load_train_state(tmp_path).model
    trained = [n for n, p in a.module.named_parameters() if p.requires_grad]
    assert sorted(saved) == sorted(trained) and all(is_adapter(k) for k in saved)
    assert sum(t.numel() for t in saved.values()) == 8_192 and {t.dtype for t in saved.values()} == {torch.float32}

    b = lora_worker(policy["dir"], stage, precision)
    assert b.load_state(tmp_path) == (1, DataPosition(0, 6, 0), {"note": "kept"})
    old_b = b.compute_logprobs(second)
    assert torch.equal(old_b, old_a)
    assert b.update(with_targets(second, old_b)).metrics == metrics_a
    ta, tb = all_tensors(a, full_precision=True), all_tensors(b, full_precision=True)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    sa, sb = dict(a.hf_tensors()), dict(b.hf_tensors())
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("stage", (0, 2))
def test_bf16_updates_the_adapters_only(policy, tmp_path, stage):
    """rl.precision bf16 (ZeRO-0: the repository's fp32 masters; ZeRO-2: DeepSpeed's): the
    module computes in bf16, the adapters alone have fp32 masters and AdamW state; after two
    updates the bf16 base is unchanged bit for bit and the adapters moved; weight sync sends
    bf16 merged weights (W + 2 B A in fp32 from the fp32 masters, then rounded) and the model
    directory the same merge in fp32."""
    from conversion.registry import megatron_to_hf
    from engine.models.megatron import mcore_state
    from engine.storage.model_dir import load_model_dir

    w = lora_worker(policy["dir"], stage, precision="bf16")
    assert w.trainer.scheme == ("master_weights" if stage == 0 else "deepspeed_bf16")
    assert {p.dtype for p in w.module.parameters()} == {torch.bfloat16}
    trained = [n for n, p in w.module.named_parameters() if p.requires_grad]
    before = all_tensors(w, full_precision=True)
    assert all(before[n].dtype == (torch.float32 if n in trained else torch.bfloat16) for n in before)
    for seed in (1, 2):
        update(w, policy["tokenizer"], seed)
    after = all_tensors(w, full_precision=True)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trained)
    assert all(not torch.equal(before[n], after[n]) for n in trained)
    moments = [s for state in w.optimizer.state.values() for k, s in state.items() if k in ("exp_avg", "exp_avg_sq")]
    assert sum(m.numel() for m in moments) == 2 * 8_192 and {m.dtype for m in moments} == {torch.float32}

    expected = {}
    for name, m in lora_layers(w.module).items():
        a, b = after[f"{name}.lora_A.{ADAPTER}.weight"], after[f"{name}.lora_B.{ADAPTER}.weight"]
        expected[f"{name}.weight"] = after[f"{name}.base_layer.weight"].float() + m.scaling[ADAPTER] * (b @ a)
    synced = dict(w.hf_tensors())
    assert {v.dtype for v in synced.values()} == {torch.bfloat16}
    assert all(torch.equal(synced[k], expected[k].to(torch.bfloat16)) for k in expected)
    loaded = load_model_dir(w.save_model(tmp_path / "model", iteration=2))
    back = dict(megatron_to_hf(loaded.hf_config, mcore_state(loaded.model)))
    assert all(torch.equal(back[k], expected[k]) for k in expected)
    assert all(torch.equal(back[k], synced[k].float()) for k in synced if k not in expected)


def test_grpo_run_on_ray_samples_from_the_merged_weights(policy, tmp_path):
    """The user's path: two GRPO steps on Ray with vLLM rollout and a ZeRO-2 LoRA actor. vLLM
    samples with exactly the trainer's weights after each sync (merged: its log-probs equal the
    LoRA forward's within 1e-4); the train state holds the adapters alone; the published model
    differs from the start only where adapters sit, each adapted weight by a matrix of the
    adapters' rank (W' - W = scale B A: 4 per projection, measured 4, 8 and 12 for megatron's
    fused layers), every other weight bit for bit the start's."""
    from config.rl import EngineConfig, RolloutConfig
    from engine.models.megatron import mcore_state
    from engine.rl.loop import run_rl
    from engine.storage.model_dir import load_model_dir

    cfg = rl_config(
        stage=2,
        steps=2,
        prompts_per_step=8,
        n_samples=8,
        micro_batch_size=16,
        checkpoint_every=1,
        rollout=RolloutConfig(backend="vllm", temperature=1.0, max_new_tokens=6),
        engine=EngineConfig(num_cpus=2),
        lora=LORA,
        optim={"lr": 1e-2, "min_lr": 1e-2},
    )
    run_rl(policy["dir"], policy["prompts"], cfg, tmp_path / "out", tmp_path / "resume", seed=0)  # the cluster stays up
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout_vs_trainer/logprob_diff_max"] < 1e-4 for r in rows), [
        r["rollout_vs_trainer/logprob_diff_max"] for r in rows
    ]
    state = load_train_state(tmp_path / "resume")
    assert state.step == 2 and state.model and all(is_adapter(k) for k in state.model)
    start, final = (
        mcore_state(load_model_dir(policy["dir"]).model),
        mcore_state(load_model_dir(tmp_path / "out" / "model").model),
    )
    moved = {k for k in start if not torch.equal(start[k], final[k])}
    assert moved and all(
        k.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")) for k in moved
    ), sorted(moved)
    ranks = {k: int(torch.linalg.matrix_rank((final[k] - start[k]).double(), rtol=1e-6)) for k in moved}
    print("rank of W' - W per adapted weight:", ranks)
    # rank 4 each; megatron's linear_qkv stacks PEFT's q, k, v updates (3 x 4), linear_fc1 gate and up (2 x 4)
    want = {"linear_qkv.weight": 12, "linear_fc1.weight": 8, "linear_proj.weight": 4, "linear_fc2.weight": 4}
    assert len(moved) == 8 and all(r == want[k.rsplit(".", 2)[-2] + ".weight"] for k, r in ranks.items()), ranks
