"""The default quickstart, run once per session for the acceptance tests (tests/acceptance/quickstart_runs.py)."""

from __future__ import annotations

import pytest

from tests.acceptance.quickstart_runs import QuickstartRuns, shipped_run


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory) -> QuickstartRuns:
    """The default quickstart, run once (``QuickstartRuns.default`` is its summary)."""
    return shipped_run(tmp_path_factory)
