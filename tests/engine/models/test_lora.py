"""LoRA on the megatron-core GPTModel (engine.models.lora): the adapted forward against the
merged weights and HF transformers, what trains and what the optimizer holds, SFT with
adapters (loss, published merged model, bit-identical resume), the RL actor's merged weight
sync, and the memory of gradients and optimizer state against full fine-tuning."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from config.lora import LoraConfig
from config.sft import SFTConfig
from config.training import OptimConfig
from conversion.spec import GPTSpec
from engine.models.lora import (
    adapter_names,
    apply_lora,
    lora_layers,
    merged_for_saving,
    merged_mcore_state,
)
from engine.models.megatron import build_gpt_model, gpt_logits, mcore_state

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

SPEC = GPTSpec(
    architecture="qwen2",
    vocab_size=300,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=128,
    max_position_embeddings=64,
    rope_theta=10000.0,
    norm_epsilon=1e-6,
    add_qkv_bias=True,
    qk_layernorm=False,
    tie_word_embeddings=True,
)
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


def _adapted(seed: int = 0, cfg: LoraConfig = LORA):
    model = build_gpt_model(SPEC, seed=0, core_attention="sdpa")
    apply_lora(model, cfg, seed=seed)
    return model


def _randomize_b(model, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora_layers(model).values():
            module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=gen) * 0.05)


def test_adapters_start_as_peft_does_and_leave_the_base_output_unchanged():
    """B = 0 (the adapted model's logits are the base model's, bit for bit) and A drawn as
    PEFT's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)); only the adapters train."""
    base = build_gpt_model(SPEC, seed=0, core_attention="sdpa")
    model = _adapted()
    ids = torch.randint(0, SPEC.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(gpt_logits(model, ids), gpt_logits(base, ids))
    layers = lora_layers(model)
    assert sorted({n.rsplit(".", 1)[-1] for n in layers}) == sorted(LORA.target_modules) and len(layers) == 8
    for name, module in layers.items():
        fan_in = module.weight.shape[1]
        bound = 1 / math.sqrt(fan_in)
        assert module.lora_A.shape == (4, fan_in) and module.lora_B.shape == (module.weight.shape[0], 4)
        top = float(module.lora_A.detach().abs().max())
        assert 0.8 * bound < top <= bound, name
        assert not module.lora_B.any() and module.lora_scale == 2.0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == adapter_names(model)
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LORA)


def test_merged_weights_give_the_adapted_forward_and_load_in_transformers(tmp_path, fixtures_dir):
    """After B is made nonzero, a model holding ``W + (alpha/r) B A`` (merged_mcore_state)
    gives the adapted model's logits within 1e-6 (fp32); the published model directory
    (merged_for_saving) exported to SafeTensors loads in transformers with the logits the
    megatron forward gives (within the fp64-referenced bound of the megatron-vs-HF tests)."""
    from transformers import AutoModelForCausalLM

    from engine.storage.hf_io import export_model_dir
    from engine.storage.model_dir import load_model_dir, save_model_dir
    from tests.numerics import hf_logits_reference

    model = _adapted().eval()
    _randomize_b(model)
    ids = torch.randint(0, SPEC.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = build_gpt_model(SPEC, seed=5, core_attention="sdpa").eval()
    state = merged_mcore_state(model)
    assert not any("lora" in k for k in state)
    plain.load_state_dict(state, strict=False)
    with torch.no_grad():
        adapted, merged = gpt_logits(model, ids), gpt_logits(plain, ids)
        base = gpt_logits(build_gpt_model(SPEC, seed=0, core_attention="sdpa").eval(), ids)
    err = float((adapted - merged).abs().max())
    print(
        f"adapted vs merged logits: max |diff| {err:.3g}; the adapters moved them by {float((adapted - base).abs().max()):.3g}"
    )
    assert err < 1e-6
    assert float((adapted - base).abs().max()) > 1e-2

    with merged_for_saving(model):
        save_model_dir(
            tmp_path / "merged", model, SPEC.to_hf_config() | {"eos_token_id": 2}, fixtures_dir / "qwen2.5-tokenizer"
        )
    assert sorted(n for n, _ in model.named_parameters() if "lora" in n) == sorted(adapter_names(model))  # put back
    loaded = load_model_dir(tmp_path / "merged", core_attention="sdpa").model.eval()
    with torch.no_grad():
        assert float((gpt_logits(loaded, ids) - merged).abs().max()) == 0.0  # the same merged tensors, saved in fp32
    hf = AutoModelForCausalLM.from_pretrained(
        export_model_dir(tmp_path / "merged", tmp_path / "hf"), attn_implementation="sdpa"
    ).eval()
    hf_logits_reference(hf, ids).check(merged[..., : SPEC.vocab_size], 1e-5, "merged LoRA model vs transformers")


def test_peft_format_adapter_on_the_hf_base_gives_the_adapted_logits(tmp_path, fixtures_dir):
    """save_peft_adapter writes adapter_config.json and adapter_model.safetensors that HF PEFT
    (an independent implementation) loads onto the base model's transformers export; its logits
    are the megatron adapted forward's (fp64-referenced bound, as the megatron-vs-HF tests),
    with linear_qkv's B split into q/k/v (2 query heads per KV group) and linear_fc1's into
    gate/up."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.models.lora import save_peft_adapter
    from engine.storage.hf_io import export_model_dir
    from engine.storage.model_dir import save_model_dir
    from tests.numerics import hf_logits_reference

    model = _adapted().eval()
    _randomize_b(model)
    base = save_model_dir(
        tmp_path / "base",
        build_gpt_model(SPEC, seed=0),
        SPEC.to_hf_config() | {"eos_token_id": 2},
        fixtures_dir / "qwen2.5-tokenizer",
    )
    adapter = save_peft_adapter(model, LORA, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert sorted(config["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    hf = AutoModelForCausalLM.from_pretrained(export_model_dir(base, tmp_path / "hf"), attn_implementation="sdpa")
    peft_model = PeftModel.from_pretrained(hf, str(adapter)).eval()
    ids = torch.randint(0, SPEC.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = gpt_logits(model, ids)
        with peft_model.disable_adapter():
            plain = peft_model(ids).logits
        assert float((peft_model(ids).logits - plain).abs().max()) > 1e-2  # the adapter changes the output
    hf_logits_reference(peft_model, ids).check(ours, 1e-5, "megatron LoRA vs PEFT LoRA on transformers")


def _optimizer_state_and_grad_bytes(model, optimizer) -> tuple[int, int]:
    state = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return state, grads


def test_lora_steps_train_the_adapters_only_and_use_a_fraction_of_the_memory(fixtures_dir):
    """Three AdamW steps of SFT's loss: base weights get no gradient and stay bit-identical, the
    adapters move, AdamW holds exp_avg and exp_avg_sq of the adapter parameters only (element
    count = 2 x adapter parameters), the loss decreases; the bytes of gradients plus optimizer
    state are measured against full fine-tuning of the same model (printed with -s)."""
    from engine.batching.collate import collate_tokens
    from engine.training.optimizer_step import build_model_optimizer, train_step
    from engine.training.sft import sft_loss

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, SPEC.vocab_size, (16,), generator=gen).tolist() for _ in range(4)]
    batch = collate_tokens(rows, [[0] * 4 + [1] * 12 for _ in rows], 0)
    optim = OptimConfig(lr=1e-2, grad_clip=10.0)

    def run(lora: bool):
        model = build_gpt_model(SPEC, seed=0, core_attention="sdpa")
        if lora:
            apply_lora(model, LORA)
        optimizer, scheduler = build_model_optimizer(model, optim, 3, "fp32")
        losses = []
        for _ in range(3):
            losses.append(train_step(model, optimizer, scheduler, [batch], sft_loss, optim.grad_clip)["loss"])
        # gradients as they stand after a backward pass (train_step frees them after the step)
        model.zero_grad(set_to_none=True)
        loss, units, _ = sft_loss(model, batch)
        loss.backward()
        return model, optimizer, losses

    base = build_gpt_model(SPEC, seed=0, core_attention="sdpa")
    model, optimizer, losses = run(lora=True)
    assert losses[-1] < losses[0] - 0.05, losses
    base_state = mcore_state(base)
    for name, p in model.named_parameters():
        if name in adapter_names(model):
            assert p.grad is not None
        else:
            assert p.grad is None and torch.equal(p, base_state[name]), name
    assert any(bool(m.lora_B.abs().max() > 0) for m in lora_layers(model).values())
    n_adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    moments = sum(
        t.numel() for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    assert moments == 2 * n_adapter
    lora_bytes = _optimizer_state_and_grad_bytes(model, optimizer)

    full, full_opt, _ = run(lora=False)
    n_full = sum(p.numel() for p in full.parameters())
    full_bytes = _optimizer_state_and_grad_bytes(full, full_opt)
    print(
        f"parameters: {n_full} (base), {n_adapter} adapter (rank 4, 4 layer kinds x 2 layers); "
        f"optimizer state + gradients in bytes: LoRA {lora_bytes[0]} + {lora_bytes[1]} = {sum(lora_bytes)}, "
        f"full fine-tuning {full_bytes[0]} + {full_bytes[1]} = {sum(full_bytes)}"
    )
    assert lora_bytes == (8 * n_adapter, 4 * n_adapter)  # fp32: two AdamW moments and one gradient per element
    assert full_bytes == (8 * n_full, 4 * n_full)


@pytest.fixture(scope="module")
def sft_base(tmp_path_factory) -> dict[str, Path]:
    from tests.engine.training.quickstart_data import make_quickstart_inputs

    return make_quickstart_inputs(tmp_path_factory.mktemp("lora_sft"), num_sft=24, num_preference=20)


class Crash(RuntimeError):
    pass


def test_lora_sft_publishes_merged_weights_and_resumes_bit_identically(sft_base, tmp_path):
    """train_sft with sft.lora: the loss decreases over 6 steps; the train state holds the
    adapters alone (and their AdamW moments); a run crashed after its step-4 checkpoint resumes
    to a model directory equal to the uninterrupted run's bit for bit; the published model is
    the merged one: its logits are the adapted model's (within 1e-6) and it differs from the base;
    with save_adapter its adapter/ holds the PEFT-named adapters (q/k/v and down_proj: 8 tensors)."""
    from engine.storage.model_dir import load_model_dir
    from engine.storage.train_state import load_train_state
    from engine.training.sft import train_sft

    cfg = SFTConfig(
        precision="fp32",
        steps=6,
        global_batch_size=8,
        micro_batch_size=4,
        max_seq_len=64,
        optim=OptimConfig(lr=5e-2, warmup_steps=1),
        checkpoint_every=4,
        log_every=1,
        lora=LoraConfig(
            enabled=True, rank=4, alpha=8.0, target_modules=["linear_qkv", "linear_fc2"], save_adapter=True
        ),
    )
    args = dict(base_model_dir=sft_base["base"], dataset_path=sft_base["sft"], cfg=cfg, seed=0)
    logged: list[float] = []
    train_sft(
        **args,
        out_dir=tmp_path / "straight",
        resume_dir=tmp_path / "resume_a",
        log_metrics=lambda m, s: logged.append(m["train/loss"]),
    )
    print("LoRA SFT losses:", [round(x, 4) for x in logged])
    assert logged[-1] < logged[0] - 0.1, logged

    state = load_train_state(tmp_path / "resume_a")
    saved = state.model
    assert sorted(saved) == sorted(
        f"decoder.layers.0.{m}.{p}"
        for m in ("self_attention.linear_qkv", "mlp.linear_fc2")
        for p in ("lora_A", "lora_B")
    )

    def crash_at_5(metrics, step):
        if step == 5:
            raise Crash()

    with pytest.raises(Crash):
        train_sft(**args, out_dir=tmp_path / "resumed", resume_dir=tmp_path / "resume_b", log_metrics=crash_at_5)
    steps: list[int] = []
    train_sft(
        **args, out_dir=tmp_path / "resumed", resume_dir=tmp_path / "resume_b", log_metrics=lambda m, s: steps.append(s)
    )
    assert steps == [5, 6]
    a = load_model_dir(tmp_path / "straight").model
    b = load_model_dir(tmp_path / "resumed").model
    sa, sb = mcore_state(a), mcore_state(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

    base = load_model_dir(sft_base["base"]).model
    adapted = load_model_dir(sft_base["base"]).model
    apply_lora(adapted, cfg.lora)
    adapted.load_state_dict(saved, strict=False)  # the final adapters, from the train state
    ids = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        published, ours, before = (gpt_logits(m.eval(), ids) for m in (a, adapted, base))
    assert float((published - ours).abs().max()) < 1e-6
    assert float((published - before).abs().max()) > 1e-3
    from safetensors.torch import load_file

    peft_keys = load_file(str(tmp_path / "straight" / "adapter" / "adapter_model.safetensors"))
    assert len(peft_keys) == 2 * 4 and all(".self_attn." in k or ".mlp.down_proj." in k for k in peft_keys)
    sbase = mcore_state(base)
    changed = sorted({k.split(".", 3)[-1] for k in sa if not torch.equal(sa[k], sbase[k])})
    assert changed == ["mlp.linear_fc2.weight", "self_attention.linear_qkv.weight"]  # only the adapted layers move


def test_bf16_lora_sft_keeps_fp32_adapters_and_resumes_bit_identically(sft_base, tmp_path):
    """sft.lora in bf16: the adapters get fp32 masters (the train state holds them in fp32, and
    nothing else); the frozen base computes in bf16, so the published merged model holds the
    base rounded to bf16 (exactly, upcast) where no adapter is and moves only the adapted
    layers; a run crashed after its step-2 checkpoint resumes to the same model bit for bit."""
    from engine.storage.model_dir import load_model_dir
    from engine.storage.train_state import load_train_state
    from engine.training.sft import train_sft

    cfg = SFTConfig(
        precision="bf16",
        steps=4,
        global_batch_size=8,
        micro_batch_size=4,
        max_seq_len=64,
        optim=OptimConfig(lr=2e-2),
        checkpoint_every=2,
        log_every=1,
        lora=LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["linear_fc1"]),
    )
    args = dict(base_model_dir=sft_base["base"], dataset_path=sft_base["sft"], cfg=cfg, seed=0)
    train_sft(**args, out_dir=tmp_path / "straight", resume_dir=tmp_path / "resume_a")
    saved = load_train_state(tmp_path / "resume_a").model
    assert sorted(saved) == ["decoder.layers.0.mlp.linear_fc1.lora_A", "decoder.layers.0.mlp.linear_fc1.lora_B"]
    assert all(t.dtype == torch.float32 for t in saved.values())

    def crash_at_3(metrics, step):
        if step == 3:
            raise Crash()

    with pytest.raises(Crash):
        train_sft(**args, out_dir=tmp_path / "resumed", resume_dir=tmp_path / "resume_b", log_metrics=crash_at_3)
    train_sft(**args, out_dir=tmp_path / "resumed", resume_dir=tmp_path / "resume_b")
    a, b = (
        mcore_state(load_model_dir(tmp_path / "straight").model),
        mcore_state(load_model_dir(tmp_path / "resumed").model),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    base = mcore_state(load_model_dir(sft_base["base"]).model)
    for k, v in base.items():
        if k.endswith("linear_fc1.weight"):
            assert not torch.equal(a[k], v.to(torch.bfloat16).float()), k
        else:
            assert torch.equal(a[k], v.to(torch.bfloat16).float()), k


def test_lora_dpo_starts_at_ln2_and_moves_only_the_adapted_layers(sft_base, tmp_path):
    """po with po.lora (DPO, 4 full-batch steps over the 16 training pairs): the adapted policy starts equal to its reference, so the
    first step's loss is ln 2 exactly as the frozen base computes it; the loss then falls; the
    published merged model differs from the base in the adapted layers only."""
    from config.po import PoConfig
    from engine.storage.model_dir import load_model_dir
    from engine.training.preference_optimization import train_preference_optimization

    cfg = PoConfig(
        enabled=True,
        precision="fp32",
        steps=4,
        global_batch_size=16,
        micro_batch_size=8,
        max_seq_len=64,
        optim=OptimConfig(lr=5e-2),
        log_every=1,
        lora=LoraConfig(enabled=True, rank=4, alpha=16.0, target_modules=["linear_proj", "linear_fc1"]),
    )
    losses: list[float] = []
    train_preference_optimization(
        sft_base["base"],
        sft_base["preference"],
        cfg,
        tmp_path / "po" / "model",
        None,
        log_metrics=lambda m, s: losses.append(m["po/loss"]),
    )
    print("LoRA DPO losses:", [round(x, 4) for x in losses])
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6) and losses[-1] < losses[0] - 0.01, losses
    before, after = (
        mcore_state(load_model_dir(sft_base["base"]).model),
        mcore_state(load_model_dir(tmp_path / "po" / "model").model),
    )
    changed = sorted({k.split(".", 3)[-1] for k in before if not torch.equal(before[k], after[k])})
    assert changed == ["mlp.linear_fc1.weight", "self_attention.linear_proj.weight"]


def test_actor_weight_sync_sends_the_merged_weights(tmp_path, fixtures_dir):
    """An RL actor with rl.lora: after an update its weight-sync buckets are the HF tensors of
    the merged weights (bit-identical to converting merged_mcore_state), its base weights are
    unchanged, and save_model writes the merged model."""
    from conversion.registry import megatron_to_hf
    from engine.backends.megatron.actor import ActorWorker
    from engine.storage.model_dir import save_model_dir
    from tests.engine.distributed.test_data_parallel import _weights, rl_config, trajectory

    hf_config = SPEC.to_hf_config() | {"eos_token_id": 2, "pad_token_id": 0}
    policy = save_model_dir(
        tmp_path / "policy", build_gpt_model(SPEC, seed=0), hf_config, fixtures_dir / "qwen2.5-tokenizer"
    )
    cfg = rl_config(algorithm="grpo", lora={"enabled": True, "rank": 4, "alpha": 8.0}, optim={"lr": 1e-2})
    actor = ActorWorker(policy, cfg, 0, 1)
    base = {k: v.clone() for k, v in mcore_state(actor.model).items() if "lora" not in k}
    traj = trajectory()
    old = actor.compute_logprobs(traj)
    actor.update(traj.with_(old_logprobs=old, ref_logprobs=old))
    state = mcore_state(actor.model)
    assert all(torch.equal(state[k], v) for k, v in base.items())
    plan = actor.hf_bucket_plan()
    synced = [t for i in range(plan.num_buckets) for t in actor.hf_bucket(i)]
    want = list(megatron_to_hf(hf_config, merged_mcore_state(actor.model)))
    assert [n for n, _ in synced] == [n for n, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(synced, want))
    moved = [n for (n, a), (_, b) in zip(synced, megatron_to_hf(hf_config, base)) if not torch.equal(a, b)]
    assert moved and all(
        n.endswith(
            (
                "q_proj.weight",
                "k_proj.weight",
                "v_proj.weight",
                "o_proj.weight",
                "gate_proj.weight",
                "up_proj.weight",
                "down_proj.weight",
            )
        )
        for n in moved
    )
    actor.save_model(tmp_path / "out", 1)
    saved = _weights(tmp_path / "out")
    merged = merged_mcore_state(actor.model)
    assert all(torch.equal(saved[k], merged[k]) for k in saved)


def test_lora_sft_at_tp2_equals_tp1_and_its_adapter_state_reshards(tp_sft_inputs, tmp_path):
    """Two LoRA SFT steps (all four layer kinds, so B and A both move: A's gradient is zero
    while B is) by ``train_sft`` in this process (TP=1) and on both ranks of a TP=2 group: on
    a column-parallel layer A is replicated and B split with the weight's rows (linear_fc1's
    [gate; up] halves each), on a row-parallel one A split with the weight's columns. The
    loss and gradient norm agree within 1e-6 of max(|value|, 1); the published merged weights
    (each rank merges its shard, loaded back at TP=1) within 1e-6, and so do the logits; the
    TP=2 run's adapter train state, read back whole, is the TP=1 run's within 1e-2 x lr with at
    most 1e-3 of the elements beyond 1e-6 (AdamW's first step of A divides ulp-level gradient
    differences by gradients near its eps, as in the actor's TP test), and resumed at TP=1 (a
    finished run re-publishes) gives the TP=2 model directory bit for bit.

    Measured (-s): loss 5.336960856119791 and grad_norm 1.0579578876495361 at both sizes;
    merged weights 3.64e-07 apart; adapters 4.53e-06 apart, 1 of 6,656 beyond 1e-6."""
    import ray

    from engine.distributed.group import WorkerGroup
    from engine.distributed.stage_group import StageRank
    from engine.rl.placement import init_ray
    from engine.storage.model_dir import load_model_dir
    from engine.storage.train_state import load_train_state
    from engine.training.sft import train_sft
    from tests.engine.distributed.test_data_parallel import _close, _weights
    from tests.engine.distributed.test_tensor_parallel_training import TP2

    init_ray(num_cpus=2)
    cfg = SFTConfig(
        precision="fp32",
        steps=2,
        global_batch_size=8,
        micro_batch_size=4,
        max_seq_len=64,
        optim=OptimConfig(lr=2e-2, warmup_steps=1),
        lora=LoraConfig(enabled=True, rank=4, alpha=8.0),
    )
    args = dict(base_model_dir=tp_sft_inputs["base"], dataset_path=tp_sft_inputs["sft"], cfg=cfg, seed=0)
    want = train_sft(**args, out_dir=tmp_path / "tp1", resume_dir=tmp_path / "resume1")
    group = WorkerGroup(StageRank, TP2, {"num_cpus": 0}, (1,))
    try:
        ray.get(group.__ray_ready__.remote())
        got = ray.get(
            group.run.remote(train_sft, {**args, "out_dir": tmp_path / "tp2", "resume_dir": tmp_path / "resume2"})
        )
    finally:
        group.kill()
    for key in ("train/loss", "train/grad_norm"):
        print(f"LoRA sft {key}: tp1 {want[key]!r} tp2 {got[key]!r}")
        assert _close(got[key], want[key]), (key, got[key], want[key])
    a, b = _weights(tmp_path / "tp1"), _weights(tmp_path / "tp2")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"merged weights TP=2 vs TP=1: max |diff| {diff:.3g}")
    assert a.keys() == b.keys() and diff < 1e-6
    base = _weights(tp_sft_inputs["base"])
    assert max(float((a[k] - base[k]).abs().max()) for k in a) > 1e-3  # the adapters moved the merged weights
    s1, s2 = load_train_state(tmp_path / "resume1").model, load_train_state(tmp_path / "resume2").model
    assert s1.keys() == s2.keys() and len(s1) == 2 * 4 * 2
    adapter_diff = torch.cat([(s1[k] - s2[k]).abs().flatten() for k in s1])
    beyond = int((adapter_diff > 1e-6).sum())
    print(
        f"adapters TP=2 vs TP=1: max |diff| {float(adapter_diff.max()):.3g}, {beyond} of {adapter_diff.numel()} "
        "beyond 1e-6"
    )
    assert float(adapter_diff.max()) < 1e-2 * cfg.optim.lr and beyond <= 1e-3 * adapter_diff.numel()
    assert all(float(s1[k].abs().max()) > 0 for k in s1)  # B moved in step 1, A in step 2
    ids = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        l1, l2 = (gpt_logits(load_model_dir(tmp_path / d).model.eval(), ids) for d in ("tp1", "tp2"))
    assert float((l1 - l2).abs().max()) < 1e-6
    train_sft(**args, out_dir=tmp_path / "again", resume_dir=tmp_path / "resume2")  # the TP=2 state at TP=1
    c = _weights(tmp_path / "again")
    assert all(torch.equal(c[k], b[k]) for k in b)


@pytest.fixture(scope="module")
def tp_sft_inputs(tmp_path_factory, fixtures_dir) -> dict[str, Path]:
    """The addition conversations on a tiny Qwen3 of 4 heads, 2 KV heads (the tensor-parallel
    tests' policy, tests/engine/distributed/test_tensor_parallel_training.py)."""
    from tests.engine.distributed.test_tensor_parallel_training import policy_dir, sft_inputs

    policy = policy_dir.__wrapped__(tmp_path_factory, fixtures_dir)
    return sft_inputs.__wrapped__(tmp_path_factory, policy)


def test_grpo_with_lora_samples_from_the_merged_weights_in_vllm(tmp_path_factory):
    """Two GRPO steps with rl.lora on vLLM rollout (tests/engine/rl/test_rl.py's random tiny policy):
    after every weight sync vLLM's log-probs of the sampled tokens equal the trainer's LoRA
    forward to fp32 noise (rollout_vs_trainer/logprob_diff_max < 1e-4, as for full
    fine-tuning: a sync without the adapters' update would be off by it), the KL to the
    reference grows from 0, and the published policy is the merged model."""
    from engine.rl.loop import run_rl
    from engine.rl.placement import init_ray
    from tests.engine.rl.test_rl import policy_weights, random_tiny_policy, read_metrics, rl_config

    init_ray(num_cpus=2)
    policy = random_tiny_policy(tmp_path_factory.mktemp("rl_lora_policy"))
    out = tmp_path_factory.mktemp("rl_lora")
    # the random policy earns no reward: the entropy bonus gives the update its gradient
    cfg = rl_config(
        "vllm",
        2,
        lora={"enabled": True, "rank": 4, "alpha": 16.0},
        optim={"lr": 2e-2, "min_lr": 2e-2},
        entropy_coef=0.1,
    )
    run_rl(policy["dir"], policy["prompts"], cfg, out, None, seed=0)
    rows = read_metrics(out)
    for r in rows:
        print(
            f"step {r['step']}: logprob_diff_max {r['rollout_vs_trainer/logprob_diff_max']:.3g}, "
            f"kl_loss {r['actor/kl_loss']:.3g}"
        )
        assert r["rollout_vs_trainer/logprob_diff_max"] < 1e-4
    assert rows[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7) and rows[1]["actor/kl_loss"] > 0
    before, after = policy_weights(policy["dir"]), policy_weights(out / "model")
    changed = sorted({k.split(".", 3)[-1] for k in before if not torch.equal(before[k], after[k])})
    assert changed == [
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.weight",
    ]
