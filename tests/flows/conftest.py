"""Fixtures shared by the tests of ``posttrain chat``, ``serve`` and ``push``."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_chat_artifacts(tmp_path_factory):
    """``tests/flows/tiny_artifacts.tiny_chat``: a tiny policy published as rl and export artifacts."""
    from tiny_artifacts import tiny_chat

    return tiny_chat(tmp_path_factory.mktemp("tiny_chat"))
