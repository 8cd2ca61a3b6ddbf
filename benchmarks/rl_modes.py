"""Quickstart RL in each engine mode, side by side: accuracy band and wall time.

Runs the quickstart's RL section (configs/quickstart.yaml) from the same SFT policy in:

- ``colocated``: GRPO, one shared bundle, synchronous (the shipped setting);
- ``async``: GRPO, disaggregated bundles, one step off-policy with partial rollouts;
- ``async_tis``: the same with truncated importance sampling (``rl.tis_cap: 2``) correcting
  for the stale sampling policy;
- ``ppo``: PPO with a critic (``rl.algorithm: gae``), colocated.

Each trained policy and the SFT policy are then evaluated on the same held-out prompts
(mean@8 at T=1, as the evaluate stage does) and the paired difference to SFT is printed with
its standard error, with the RL wall time and its ratio to the colocated run.

Usage (after ``posttrain run configs/quickstart.yaml`` has produced an SFT artifact)::

    .venv/bin/python -m benchmarks.rl_modes [--steps 100] [--modes colocated async ppo]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from config.load import load_config
from config.rl import CriticConfig, EngineConfig, RLConfig
from config.training import OptimConfig

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "work" / "benchmarks" / "rl_modes"


def mode_config(base: RLConfig, mode: str, steps: int) -> RLConfig:
    """The quickstart ``rl`` section adapted to ``mode`` (colocated | async | ppo)."""
    engine = base.engine.model_dump()
    update: dict = {"steps": steps}
    if mode in ("async", "async_tis"):
        update["engine"] = EngineConfig(
            **{
                **engine,
                "placement": "disaggregated",
                "rollout_cpus": 1,
                "off_policy_steps": 1,
                "partial_rollout_chunk_tokens": 2,
            }
        )
        if mode == "async_tis":  # weight stale tokens by p_trainer / p_rollout (AReaL's decoupled PPO), capped
            update["tis_cap"] = 2.0
    elif mode == "ppo":
        update |= {
            "algorithm": "gae",
            "kl": base.kl.model_copy(update={"coef": 0.01, "in_reward": True}),
            "critic": CriticConfig(optim=OptimConfig(lr=1e-3, warmup_steps=5), lam=1.0, warmup_steps=5),
        }
    elif mode != "colocated":
        raise ValueError(f"unknown mode {mode!r}; expected colocated, async, async_tis or ppo")
    return RLConfig.model_validate(
        {**base.model_dump(), **{k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in update.items()}}
    )


def latest_sft_model() -> Path:
    """The newest ``artifacts/sft/*/model`` (raises FileNotFoundError naming the command to run)."""
    found = sorted((REPO / "artifacts" / "sft").glob("*/model"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(
            "no SFT artifact under artifacts/sft: run `posttrain run configs/quickstart.yaml` first"
        )
    return found[-1]


def main(argv: list[str] | None = None) -> None:
    from engine.evaluation.scoring import evaluate_model_dirs
    from engine.evaluation.statistics import paired_difference
    from engine.rl.loop import run_rl
    from engine.rl.placement import shutdown_ray

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    parser.add_argument("--policy-dir", default=None, help="SFT model directory (default: newest artifacts/sft)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--modes", nargs="+", default=["colocated", "async", "ppo"])
    args = parser.parse_args(argv)

    cfg = load_config(args.config)
    policy = Path(args.policy_dir) if args.policy_dir else latest_sft_model()
    train, held_out = REPO / cfg.data.rl_train.path, REPO / cfg.data.rl_eval.path
    runs: dict[str, tuple[Path, float, dict]] = {}
    for mode in args.modes:
        out = WORK / mode
        t0 = time.perf_counter()
        last = run_rl(policy, train, mode_config(cfg.rl, mode, args.steps), out, None, seed=cfg.run.seed)
        runs[mode] = (out / "model", time.perf_counter() - t0, last)
        shutdown_ray()
        print(f"{mode}: RL {runs[mode][1]:.0f} s, last training reward {last['critic/score/mean']:.3f}", flush=True)
    results = evaluate_model_dirs(
        {"sft": policy, **{m: r[0] for m, r in runs.items()}},
        held_out,
        cfg.evaluate,
        verifier=cfg.rl.reward.verifier,
        seed=cfg.run.seed,
    )
    base_time = runs.get("colocated", (None, None))[1]
    print(
        f"\npolicy: {policy}\nsteps: {args.steps}; held-out mean@{cfg.evaluate.samples_per_prompt} at "
        f"T={cfg.evaluate.temperature}\n"
    )
    print(f"{'mode':<10} {'accuracy':>16} {'minus SFT (paired)':>20} {'RL s':>7} {'time / colocated':>17}")
    sft = results["sft"]
    print(f"{'sft':<10} {sft['accuracy']:>9.3f} ± {sft['accuracy_se']:.3f}")
    for mode, (_, seconds, _) in runs.items():
        r = results[mode]
        diff, se = paired_difference(sft, r)
        ratio = f"{seconds / base_time:.2f}" if base_time else "-"
        print(
            f"{mode:<10} {r['accuracy']:>9.3f} ± {r['accuracy_se']:.3f} {diff:>+12.3f} ± {se:.3f} {seconds:>7.0f} {ratio:>17}"
        )


if __name__ == "__main__":
    main()
