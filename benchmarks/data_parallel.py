"""Data parallelism on this machine's cores: DP=2 ranks x 1 thread vs DP=1 x 2 threads.

    python -m benchmarks.data_parallel                    # 25m, 4 rounds
    python -m benchmarks.data_parallel --size 0.3m --rounds 2

The training half of an RL step of the megatron actor (``engine.backends.megatron.actor.ActorWorker``),
on one fixed batch of ``--rows`` responses (a ``--prompt-tokens`` prompt and a
``--response-tokens`` response each, random token ids): the old-log-prob pass
(``compute_logprobs``) and the policy update (``update``, one optimizer step), then the weight
gather a sync makes (every weight-sync bucket from rank 0, ``hf_bucket``). Both sides are Ray
actors on the same machine and the same weights:

- ``dp1``: one actor worker with 2 torch threads;
- ``dp2``: an ``engine.distributed.group.WorkerGroup`` of two data-parallel ranks (gloo), 1
  thread each; each rank gets half the batch, gradients are summed by one fp32 all-reduce.

The sides take turns in rounds (``dp1 dp2 dp1 dp2 ...``, never at the same time) and the
ratio dp2/dp1 is taken per round and reported as the median with its range, with the load
average before each round and the seconds the ranks spent in the all-reduce. The goal is a
ratio <= 1.15: on the same cores, data parallelism should cost only its communication.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.models import SHAPES, load_avg


def _model_dir(size: str, root: Path, tokenizer_dir: Path) -> Path:
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model
    from engine.storage.model_dir import save_model_dir

    shape = SHAPES[size]
    spec = GPTSpec(
        architecture="qwen2",
        vocab_size=8192,
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        ffn_hidden_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=True,
    )
    model = build_gpt_model(spec, seed=0)
    params = sum(p.numel() for p in model.parameters())
    print(f"model {size}: {params / 1e6:.1f}M parameters")
    return save_model_dir(
        root / f"policy-{size}", model, spec.to_hf_config() | {"eos_token_id": 2, "pad_token_id": 0}, tokenizer_dir
    )


def _batch(rows: int, prompt_tokens: int, response_tokens: int):
    from engine.rollout.base import RolloutOutput
    from engine.trajectory import Trajectory

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8192, (prompt_tokens,), generator=gen).tolist() for _ in range(rows // 4)]
    outs = [
        [
            RolloutOutput(
                tuple(torch.randint(3, 8192, (response_tokens,), generator=gen).tolist()),
                (-1.0,) * response_tokens,
                "length",
            )
            for _ in range(4)
        ]
        for _ in prompts
    ]
    traj = Trajectory.from_rollout(prompts, outs, pad_id=0)
    adv = torch.linspace(-1.0, 1.0, len(traj))[:, None] * traj.response_mask
    return traj.with_(advantages=adv)


def _round(handle, traj) -> tuple[float, float]:
    import ray

    t0 = time.perf_counter()
    old = ray.get(handle.compute_logprobs.remote(traj))
    ray.get(handle.update.remote(traj.with_(old_logprobs=old)))
    train = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = ray.get(handle.hf_bucket_plan.remote())
    for i in range(plan.num_buckets):
        ray.get(handle.hf_bucket.remote(i))
    return train, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="25m", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    import ray

    from config.parallel import ParallelConfig
    from config.rl import RLConfig
    from engine.backends.megatron.actor import ActorWorker
    from engine.distributed.group import WorkerGroup
    from engine.rl.placement import init_ray
    from engine.training.actor import actor_norm

    fixtures = Path(os.environ.get("POSTTRAIN_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
    cfg = RLConfig(
        micro_batch_size=4, precision="fp32", kl={"coef": 0.0}, rollout={"max_new_tokens": args.response_tokens}
    )
    init_ray(num_cpus=2)
    with tempfile.TemporaryDirectory() as tmp:
        policy = _model_dir(args.size, Path(tmp), fixtures / "qwen2.5-tokenizer")
        traj = _batch(args.rows, args.prompt_tokens, args.response_tokens)
        dp1 = ray.remote(ActorWorker).options(num_cpus=0).remote(str(policy), cfg, 0, 2)
        dp2 = WorkerGroup(
            ActorWorker,
            ParallelConfig(data_parallel_size=2),
            {"num_cpus": 0},
            (str(policy), cfg, 0, 1),
            norm_fn=lambda t: actor_norm(t, cfg),
        )
        ray.get([dp1.__ray_ready__.remote(), dp2.__ray_ready__.remote()])
        _round(dp1, traj), _round(dp2, traj)  # warm-up: first forward, bucket plans
        comm0 = ray.get([r.comm_seconds.remote() for r in dp2.ranks])
        rows = []
        for index in range(args.rounds):
            load = load_avg()
            a_train, a_gather = _round(dp1, traj)
            b_train, b_gather = _round(dp2, traj)
            rows.append((index + 1, load, a_train, b_train, a_gather, b_gather))
            print(
                f"round {index + 1}: load {load:.1f}  dp1 {a_train:.2f} s  dp2 {b_train:.2f} s  "
                f"ratio {b_train / a_train:.3f}  gather {a_gather:.2f} / {b_gather:.2f} s",
                flush=True,
            )
        comm = ray.get([r.comm_seconds.remote() for r in dp2.ranks])
        dp2.kill()
        ray.kill(dp1)
    ratios = [r[3] / r[2] for r in rows]
    allreduce = [(c["all_reduce_s"] - c0["all_reduce_s"]) / args.rounds for c, c0 in zip(comm, comm0)]
    tokens = args.rows * (args.prompt_tokens + args.response_tokens)
    print()
    print(
        "| size | rows x tokens | dp1 s/step (median) | dp2 s/step (median) | dp2/dp1 median [range] | "
        "all-reduce s/step per rank | weight gather s (dp1 / dp2) |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.size} | {args.rows} x {args.prompt_tokens + args.response_tokens} ({tokens} tokens) | "
        f"{statistics.median(r[2] for r in rows):.2f} | {statistics.median(r[3] for r in rows):.2f} | "
        f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] | "
        f"{' / '.join(f'{a:.3f}' for a in allreduce)} | "
        f"{statistics.median(r[4] for r in rows):.2f} / {statistics.median(r[5] for r in rows):.2f} |"
    )
    print(f"goal: dp2/dp1 <= 1.15 -> {'met' if statistics.median(ratios) <= 1.15 else 'not met'}")


if __name__ == "__main__":
    main()
