"""The default quickstart, run once per session for the acceptance tests (tests/acceptance/quickstart_runs.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.acceptance.quickstart_runs import QuickstartRuns


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory) -> QuickstartRuns:
    """The default quickstart, run once (``QuickstartRuns.default`` is its summary)."""
    keep = os.environ.get("POSTTRAIN_ACCEPTANCE_WORK")
    work = Path(keep) if keep else tmp_path_factory.mktemp("acceptance_quickstart")
    work.mkdir(parents=True, exist_ok=True)
    return QuickstartRuns(work)
