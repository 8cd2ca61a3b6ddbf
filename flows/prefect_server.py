"""The temporary Prefect API server a CLI command uses when no server is configured.

Prefect starts such a server by itself, but as a child in the CLI's process group: a
Ctrl-C in the terminal signals the whole foreground group, the server dies with the
command, and the flow engine then retries the dead API for minutes before giving up. This
module starts the same server (Prefect's ``create_app`` under uvicorn, as Prefect does) in
its own session, so Ctrl-C reaches only the command, which reports the interrupted run to
a live API and stops the server on its way out. On Linux the server also receives SIGTERM
when the command dies without cleaning up (``PR_SET_PDEATHSIG``), so a SIGKILL of the
command does not leave it behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import prefect
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_DRAIN_TIMEOUT_S = 10.0


def _detach_from_parent_signals(parent_pid: int) -> None:
    """Runs in the server child between fork and exec: SIGTERM when the parent dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)


def _session_server():
    """A :class:`SubprocessASGIServer` whose uvicorn process starts in a new session.

    Built on first use: importing Prefect's server module takes seconds, and commands that
    use a configured API never need it.
    """
    from prefect.server.api.server import SubprocessASGIServer

    class SessionServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            env = {
                **os.environ,
                **get_current_settings().to_environment_variables(exclude_unset=True),
                "PREFECT_UI_ENABLED": "0",
                "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1",
            }
            command = [
                sys.executable, "-m", "uvicorn",
                "--app-dir", str(Path(prefect.__file__).parent.parent),
                "--factory", "prefect.server.api.server:create_app",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "error", "--lifespan", "on",
            ]  # fmt: skip
            parent = os.getpid()
            return subprocess.Popen(
                command, env=env, start_new_session=True, preexec_fn=lambda: _detach_from_parent_signals(parent)
            )

    return SessionServer()


@contextmanager
def prefect_api() -> Iterator[str]:
    """Make a Prefect API available for the duration of the block; yield its URL.

    A configured ``PREFECT_API_URL`` (a running server or Prefect Cloud) is used as is.
    Otherwise Prefect's temporary server is started in a session of its own on a free
    local port, ``PREFECT_API_URL`` points at it inside the block, and it is stopped when
    the block exits, however it exits.

    Raises:
        RuntimeError: the temporary server did not answer within
            ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``.
    """
    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    server = _session_server()
    try:
        server.start()
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            try:
                yield server.api_url
            finally:
                # Send what is still queued (the crash report of an interrupted run, above
                # all) while the server is up; afterwards each send would be retried for a
                # minute against a closed port.
                APILogWorker.drain_all(timeout=_DRAIN_TIMEOUT_S)
                EventsWorker.drain_all(timeout=_DRAIN_TIMEOUT_S)
    finally:
        server.stop()
