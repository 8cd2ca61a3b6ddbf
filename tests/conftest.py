"""Session-wide test set-up: where the real public fixtures live, and quiet, local services."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Keep every service local and quiet: W&B offline, Prefect without telemetry.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _fixtures_dir() -> Path:
    """The shared real inputs: $POSTTRAIN_FIXTURES, else ../shared/fixtures beside the checkout."""
    env = os.environ.get("POSTTRAIN_FIXTURES")
    candidates = [Path(env)] if env else []
    candidates += [REPO.parent / "shared" / "fixtures"]
    for c in candidates:
        if (c / "README.md").is_file():
            return c
    raise RuntimeError(
        "real test fixtures not found; set POSTTRAIN_FIXTURES to the shared fixtures folder "
        f"(looked in: {', '.join(map(str, candidates))})"
    )


FIXTURES = _fixtures_dir()


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """Path of the read-only real public inputs (tokenizer, GSM8K, MATH-500, HH-RLHF, ...)."""
    return FIXTURES
