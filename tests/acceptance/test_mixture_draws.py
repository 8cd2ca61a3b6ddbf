"""The RL data mixture draws each source as often as its weight says, on a real run's metrics.

docs/algorithms.md, Data mixtures (``data.rl_train`` as a list of sources), "Drawing": every
prompt's source is a categorical draw with probabilities ``weight_i / sum(weight)``, so over
``n`` prompts the count from source ``i`` is Binomial(n, p_i) and the fractions match the
weights up to ``sqrt(p_i (1 - p_i) / n)``.

The cheapest real run that draws from a mixture: the quickstart's prepare, validate and convert
stages, then its rl stage (the quickstart's GRPO section, vLLM rollouts, 64 prompts a step) for
16 steps on the quickstart's own RL prompts split into two sources weighted 1 and 3, from the
converted base model (``sft.enabled=false``, ``rm.enabled=false``: the draws do not depend on the
policy). The per-step ``reward/<source>/count`` of the rl artifact's ``metrics.jsonl`` are summed.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest
import yaml
from e2e_support import REPO, env_for, posttrain

pytestmark = [pytest.mark.slow, pytest.mark.acceptance]

WEIGHTS = {"few": 1.0, "many": 3.0}
STEPS = 16


def test_mixture_draw_counts_match_the_weights_within_the_binomial_se(tmp_path):
    """docs/algorithms.md, Data mixtures: the fraction of the run's prompts drawn from each
    source is its weight's share, within 2 binomial SE ``sqrt(p (1 - p) / n)`` over the run's
    ``n`` = 16 x 64 = 1024 prompts; every step draws exactly ``rl.prompts_per_step`` prompts."""
    work, env = tmp_path, env_for(tmp_path)
    config = shutil.copy(REPO / "configs" / "quickstart.yaml", work / "quickstart.yaml")
    t0 = time.perf_counter()
    posttrain(["stage", "prepare", str(config)], cwd=work, env=env)
    rows = (work / "work" / "quickstart" / "rl_train.jsonl").read_text().splitlines()
    (work / "few.jsonl").write_text("\n".join(rows[:1000]) + "\n")
    (work / "many.jsonl").write_text("\n".join(rows[1000:]) + "\n")
    cfg = yaml.safe_load(Path(config).read_text())
    cfg["data"]["rl_train"] = [
        {"name": name, "path": f"{name}.jsonl", "format": "prompt_label", "weight": w} for name, w in WEIGHTS.items()
    ]
    cfg["wandb"]["enabled"] = False
    cfg["sft"]["enabled"] = False
    cfg["rm"]["enabled"] = False
    cfg["rl"]["steps"] = STEPS
    mixture = work / "mixture.yaml"
    mixture.write_text(yaml.safe_dump(cfg, sort_keys=False))
    for stage in ("validate", "convert", "rl"):
        posttrain(["stage", stage, str(mixture)], cwd=work, env=env)
    (rl_dir,) = (work / "artifacts" / "rl").glob("*/metrics.jsonl")
    steps = [json.loads(line) for line in rl_dir.read_text().splitlines() if line.strip()]
    print(f"mixture run: {time.perf_counter() - t0:.0f} s", flush=True)

    per_step = cfg["rl"]["prompts_per_step"]
    assert len(steps) == STEPS
    for row in steps:
        assert sum(row[f"reward/{name}/count"] for name in WEIGHTS) == per_step, row
    n = STEPS * per_step
    lines = []
    for name, weight in WEIGHTS.items():
        p = weight / sum(WEIGHTS.values())
        se = math.sqrt(p * (1 - p) / n)
        frac = sum(row[f"reward/{name}/count"] for row in steps) / n
        lines.append(f"{name}: drawn {frac:.4f} of {n}, weight share {p:.4f} +- {se:.4f} ({(frac - p) / se:+.2f} SE)")
        print(lines[-1], flush=True)
        assert abs(frac - p) < 2 * se, lines
