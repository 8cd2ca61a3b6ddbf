"""Fixtures shared by the trainer tests: the tiny quickstart-shaped inputs, built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.training.quickstart_data import make_quickstart_inputs


@pytest.fixture(scope="session")
def quickstart_inputs(tmp_path_factory) -> dict[str, Path]:
    """``{"sft", "preference", "base"}``: addition data and a tiny random base model directory
    (:func:`tests.engine.training.quickstart_data.make_quickstart_inputs`)."""
    return make_quickstart_inputs(tmp_path_factory.mktemp("quickstart_tiny"))
