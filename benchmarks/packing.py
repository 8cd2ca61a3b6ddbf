"""Trained tokens per second of the actor update: right-padded vs packed micro-batches.

    python -m benchmarks.packing                       # defaults below
    python -m benchmarks.packing --num-seqs 96 --max-tokens 4096 --threads 2 --repeats 3

Builds one Qwen2-shaped megatron-core policy on CPU in float32 (default: hidden 256,
4 layers, 8 query / 2 key-value heads, an 8k vocabulary, tied embeddings, the ``sdpa`` core
attention) and one batch of ``--num-seqs`` prompt + response sequences whose lengths follow
a long-tailed distribution: prompts ``lognormal(median 48, sigma 0.5)``, responses
``lognormal(median 64, sigma 1.0)``, each clipped to ``[1, --max-len / 2]``, so a few
responses are many times the median. The rows are shuffled (as a rollout batch is), and
the same model, batch and loss (``engine.training.actor.actor_loss_fn``, token-mean PPO clip)
are timed in three ways:

- ``padded``: micro-batches of ``--micro-batch-size`` consecutive rows, each right-padded to
  its longest row (``rl.packing: false``, the default);
- ``packed``: the same micro-batches, each packed into one row without padding
  (``rl.packing: true``);
- ``packed+budget``: packed micro-batches of at most ``--max-tokens`` real tokens, balanced
  by Karmarkar-Karp (``rl.packing: true``, ``rl.max_tokens_per_micro_batch``).

One pass is the forward and backward of the actor loss over every micro-batch
(``engine.training.optimizer_step.accumulate_gradients``; no optimizer step). The time is the fastest of
``--repeats`` passes after one untimed warm-up pass, the modes' passes interleaved (so load
from other processes hits them alike); trained tokens/s is the batch's real
(prompt + response) tokens over that time, the same numerator for every mode. The process's
CPU time (``time.process_time``) is reported beside the wall time: on a shared machine it
is the steadier measure of the work each mode does (with one thread, the default, it has no
OpenMP spin-waiting in it). The loss of each mode is printed too: they agree to ~1e-7 (the
split and the packing do not change it).
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def model_config(hidden: int, layers: int, vocab: int) -> dict:
    """A Qwen2 ``config.json`` dict: ``layers`` layers of width ``hidden`` (8 query heads,
    2 key-value heads, FFN 2.75x), ``vocab`` tokens, tied embeddings."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": int(hidden * 2.75),
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }


def long_tail_batch(num_seqs: int, max_len: int, vocab: int, seed: int):
    """A shuffled :class:`engine.trajectory.Trajectory` with lognormal prompt and response lengths
    (see the module docstring), random tokens, unit advantages of random sign and
    old log-probs of ``-log(vocab)``."""
    from engine.rollout.base import RolloutOutput
    from engine.trajectory import Trajectory

    gen = torch.Generator().manual_seed(seed)
    half = max_len // 2

    def lengths(median: float, sigma: float) -> list[int]:
        draws = torch.exp(torch.log(torch.tensor(median)) + sigma * torch.randn(num_seqs, generator=gen))
        return draws.round().clamp(1, half).long().tolist()

    prompt_lens, response_lens = lengths(48.0, 0.5), lengths(64.0, 1.0)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for p in prompt_lens]
    outs = [
        [RolloutOutput(tuple(torch.randint(1, vocab, (n,), generator=gen).tolist()), (0.0,) * n, "stop")]
        for n in response_lens
    ]
    traj = Trajectory.from_rollout(prompts, outs, pad_id=0)
    traj = traj.select(torch.randperm(len(traj), generator=gen))
    mask = traj.response_mask
    sign = torch.where(torch.rand(len(traj), 1, generator=gen) < 0.5, -1.0, 1.0)
    old = torch.full(mask.shape, -float(torch.log(torch.tensor(float(vocab))))) * mask
    return traj.with_(advantages=sign * mask, old_logprobs=old)


def prepare_mode(traj, packing: bool, micro_batch_size: int, max_tokens: int | None) -> dict:
    """One mode's micro-batches and actor loss (token-mean PPO clip, no KL, no entropy bonus)."""
    from config.rl import KLConfig, RLConfig, RolloutConfig
    from engine.algorithms.aggregation import global_norm
    from engine.training.actor import actor_loss_fn
    from engine.trajectory import actor_micro_batches

    cfg = RLConfig(
        packing=packing,
        micro_batch_size=micro_batch_size,
        max_tokens_per_micro_batch=max_tokens,
        kl=KLConfig(coef=0.0),
        rollout=RolloutConfig(max_new_tokens=int(traj.response_ids.size(1))),
    )
    micro = actor_micro_batches(traj, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
    norm = global_norm([mb.response_mask for mb in micro], max_response_length=cfg.rollout.max_new_tokens)
    positions = sum(mb.num_tokens if packing else mb.input_ids.numel() for mb in micro)
    return {
        "micro": micro,
        "loss_fn": actor_loss_fn(cfg, 1.0, norm),
        "micro_batches": len(micro),
        "positions": positions,
        "times": [],
        "loss": 0.0,
    }


def time_pass(model, mode: dict) -> None:
    """One forward + backward pass of the actor loss over every micro-batch of ``mode``
    (``engine.training.optimizer_step.accumulate_gradients``); appends ``(wall s, process CPU s)`` to ``mode["times"]``."""
    from engine.training.optimizer_step import accumulate_gradients

    t0, c0 = time.perf_counter(), time.process_time()
    mode["loss"], _, _ = accumulate_gradients(model, mode["micro"], mode["loss_fn"], normalized=True)
    mode["times"].append((time.perf_counter() - t0, time.process_time() - c0))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-seqs", type=int, default=64, help="sequences in the batch")
    parser.add_argument("--max-len", type=int, default=1024, help="prompt and response are each at most half this")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="rows per micro-batch (padded, packed)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="token budget per micro-batch (packed+budget)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per mode (fastest is reported)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: CPU time is the work done, without OpenMP spin-waiting)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    args = parser.parse_args(argv)

    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model

    torch.set_num_threads(args.threads)
    cfg = model_config(args.hidden, args.layers, args.vocab)
    model = build_gpt_model(GPTSpec.from_hf_config(cfg), seed=args.seed, core_attention="sdpa")
    traj = long_tail_batch(args.num_seqs, args.max_len, args.vocab, args.seed)
    tokens = traj.num_tokens
    lengths = (traj.prompt_lengths + traj.response_lengths).float()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"Qwen2-shaped policy: {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, vocab "
        f"{args.vocab}), float32, CPU, {args.threads} thread(s); best of {args.repeats} passes"
    )
    print(
        f"batch: {len(traj)} sequences, {tokens} real tokens; length median {lengths.median():.0f}, "
        f"mean {lengths.mean():.0f}, max {lengths.max():.0f}"
    )
    modes = {"padded": (False, None), "packed": (True, None), "packed+budget": (True, args.max_tokens)}
    rows = {
        name: prepare_mode(traj, packing, args.micro_batch_size, budget) for name, (packing, budget) in modes.items()
    }
    for r in rows.values():  # untimed warm-up pass (allocator, kernels)
        time_pass(model, r)
        r["times"].clear()
    for _ in range(args.repeats):  # interleaved, so a busy machine slows every mode alike
        for r in rows.values():
            time_pass(model, r)
    for r in rows.values():
        r["seconds"] = min(w for w, _ in r["times"])
        r["cpu_seconds"] = min(c for _, c in r["times"])
    base, base_cpu = tokens / rows["padded"]["seconds"], tokens / rows["padded"]["cpu_seconds"]
    head = (
        "mode",
        "micro-batches",
        "positions run",
        "pad share",
        "wall s",
        "trained tokens/s",
        "vs padded",
        "CPU s",
        "tokens/CPU-s",
        "vs padded (CPU)",
        "loss",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, r in rows.items():
        rate, rate_cpu = tokens / r["seconds"], tokens / r["cpu_seconds"]
        cells = (
            name,
            str(r["micro_batches"]),
            str(r["positions"]),
            f"{1 - tokens / r['positions']:.0%}",
            f"{r['seconds']:.2f}",
            f"{rate:.0f}",
            f"{rate / base:.2f}x",
            f"{r['cpu_seconds']:.2f}",
            f"{rate_cpu:.0f}",
            f"{rate_cpu / base_cpu:.2f}x",
            f"{r['loss']:.7f}",
        )
        print("| " + " | ".join(cells) + " |")
    print(
        f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (wall times are only "
        "meaningful on an otherwise idle machine; CPU times count this process's work alone)"
    )


if __name__ == "__main__":
    main()
