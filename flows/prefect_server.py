"""Prefect servers: the temporary one a CLI command uses when no server is configured, and
a log filter for the long-running ``prefect server start`` on SQLite.

Prefect starts a temporary server by itself, but as a child in the CLI's process group: a
Ctrl-C in the terminal signals the whole foreground group, the server dies with the
command, and the flow engine then retries the dead API for minutes before giving up. This
module starts the same server (Prefect's ``create_app`` under uvicorn, as Prefect does) in
its own session, so Ctrl-C reaches only the command, which reports the interrupted run to
a live API and stops the server on its way out. On Linux the server also receives SIGTERM
when the command dies without cleaning up (``PR_SET_PDEATHSIG``), so a SIGKILL of the
command does not leave it behind.

Only the standard library is imported at module level: the logging configuration
``prefect-server-logging.yml`` names :class:`RetriedSQLiteLockFilter`, and Prefect loads that
configuration while ``import prefect`` is still running.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_DRAIN_TIMEOUT_S = 10.0
_SQLITE_BUSY_NAMES = {"SQLITE_BUSY", "SQLITE_BUSY_SNAPSHOT"}
# Logger -> the start of the messages it logs for a failure that is tried again.
_RETRIED_FAILURES = {
    # pydocket 0.27: Retry and Perpetual log "↩ [duration] call" when they reschedule a failed task
    "docket.dependencies": "↩",
    # prefect/server/orchestration/rules.py (logger "prefect.server") logs this, then re-raises a
    # retryable error: the API answers 503 and the client retries, or the docket task fails and
    # its service tries again on its next loop
    "prefect.server": "Encountered error during state validation",
    # prefect/server/utilities/worker_channel.py: a worker's heartbeat that failed to persist
    # closes the worker's channel with HEARTBEAT_PERSISTENCE_FAILED, a close policy marked
    # retryable: the worker reconnects and heartbeats again
    "prefect.server.utilities.worker_channel": "Worker channel heartbeat persistence failed",
    # prefect/server/events/triggers.py: the triggers service's periodic evaluation (sweeping
    # closed buckets) logs a failed pass, sleeps and runs the whole pass again
    "prefect.server.events.triggers": "Error running periodic evaluation",
}


class RetriedSQLiteLockFilter(logging.Filter):
    """Drop the log record of a Prefect server failure that hit SQLite's "database is locked"
    and is tried again, unless ``PREFECT_SERVER_LOG_RETRYABLE_ERRORS`` is true: Prefect's own
    rule for retryable SQLite errors, applied to the loggers it misses.

    Prefect 3.7.7 hides these errors with a filter on the ``uvicorn.error`` and
    ``docket.worker`` loggers (``prefect/server/api/server.py``,
    ``_install_sqlite_locked_log_filter``), but two more report them, with the traceback, at
    ERROR: pydocket 0.27 logs each failed attempt it retries (``Retry``) or reschedules
    (``Perpetual``) from ``docket.dependencies``, and the orchestration rules log a failed
    state change before re-raising it for a retry. With one polling worker the first comes
    about every 10 s: ``mark_deployments_ready`` reads, then writes, in a deferred SQLite
    transaction, and loses the write lock to ``mark_work_queues_ready``, queued by the same
    poll; SQLite then fails at once, without waiting out its busy timeout, and docket retries
    the task (5 attempts, 0.5 s apart). Prefect's worker channel logs a heartbeat that lost the
    lock the same way, then closes the channel with a retryable reason and the worker
    reconnects; the triggers service logs a periodic evaluation that lost it, and evaluates
    again on its next loop. Only those records (``_RETRIED_FAILURES``: logger and
    message) whose exception is SQLite's SQLITE_BUSY / "database is locked" are dropped; every
    other record passes, as does a task's final failure (logged by ``docket.worker``).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Return False to drop ``record`` (see the class docstring), True to keep it."""
        retried = _RETRIED_FAILURES.get(record.name)
        exc = record.exc_info[1] if record.exc_info else None
        orig = getattr(exc, "orig", None)
        if not (
            retried
            and isinstance(record.msg, str)
            and record.msg.startswith(retried)
            and isinstance(orig, sqlite3.OperationalError)
        ):
            return True
        if getattr(orig, "sqlite_errorname", None) not in _SQLITE_BUSY_NAMES and "database is locked" not in orig.args:
            return True
        # prefect: 1-2 s to import; only flows and stage runs need it
        from prefect.settings import get_current_settings

        return get_current_settings().server.log_retryable_errors


def _detach_from_parent_signals(parent_pid: int) -> None:
    """Runs in the server child between fork and exec: SIGTERM when the parent dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)


class TemporaryServer:
    """Prefect's temporary API server (``create_app`` under uvicorn, as Prefect 3.7.7's
    ``SubprocessASGIServer`` runs it), in a session of its own, whose start waits out a slow
    health check.

    Written here rather than subclassed from Prefect's class: importing
    ``prefect.server.api.server`` (the whole API app) costs 2-3 s of CPU in every command
    that starts a server, and only the child process serves the app.

    Attributes:
        port: the local port (chosen on :meth:`start`; None before).
        server_process: the uvicorn process while it runs, else None.
        running: whether :meth:`start` succeeded and :meth:`stop` has not run.
    """

    _PORTS = range(8000, 9000)  # Prefect's own range for its temporary servers

    def __init__(self) -> None:
        self.port: int | None = None
        self.server_process: subprocess.Popen | None = None
        self.running = False

    @property
    def address(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        """The API's URL, what ``PREFECT_API_URL`` is set to."""
        return f"{self.address}/api"

    def start(self, timeout: float | None = None) -> None:
        """Start the server and return once ``/health`` answers 200. A health check whose
        answer times out counts as "not up yet", as a refused connection does, and the limit
        is wall time (Prefect's loop gives up on httpx's first 5 s read time-out: on a busy
        machine uvicorn accepts the connection before the app answers). A port taken
        meanwhile (uvicorn's exit code 3) is replaced by another.

        Args:
            timeout: seconds; default ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``.

        Raises:
            RuntimeError: no healthy answer within the limit, or the server exited
                (its exit code in the message).
        """
        # prefect: 1-2 s to import; only flows and stage runs need it
        import httpx
        from prefect.logging import get_logger
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        if self.running:
            return
        self.port = self.port or _free_port(self._PORTS)
        # Prefect's own message and logger: commands' logs (and the fault tests) read the port from it
        get_logger().info(
            f"Starting temporary server on {self.address}\nSee "
            "https://docs.prefect.io/v3/concepts/server#how-to-guides "
            "for more information on running a dedicated Prefect server."
        )
        self.running = True
        self.server_process = self._run_uvicorn_command()
        atexit.register(self.stop)
        limit = timeout or PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
        deadline = time.monotonic() + limit
        with httpx.Client() as client:
            while (left := deadline - time.monotonic()) > 0:
                code = self.server_process.poll()
                if code == 3:  # uvicorn's exit code when the port was taken meanwhile
                    self.port = _free_port(self._PORTS)
                    self.server_process = self._run_uvicorn_command()
                    continue
                if code is not None:
                    break
                try:
                    if client.get(f"{self.api_url}/health", timeout=min(5.0, left)).status_code == 200:
                        return
                except (httpx.ConnectError, httpx.TimeoutException):
                    pass
                time.sleep(0.1)
        self.running = False
        exited = self.server_process.poll()
        raise RuntimeError(
            "Timed out while attempting to connect to ephemeral Prefect API server."
            + (f" Ephemeral server process exited with code {exited}." if exited is not None else "")
        )

    def _run_uvicorn_command(self) -> subprocess.Popen:
        # prefect: 1-2 s to import; only flows and stage runs need it
        import prefect
        from prefect.settings import get_current_settings

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

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 5 s, as Prefect does) and reap it; safe
        to call twice."""
        # prefect: 1-2 s to import; only flows and stage runs need it
        from prefect.logging import get_logger

        if self.server_process is not None:
            get_logger().info(f"Stopping temporary server on {self.address}")
            self.server_process.terminate()
            try:
                self.server_process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.server_process.kill()
                self.server_process.wait()
            finally:
                self.server_process = None
        self.running = False


def _free_port(ports: range) -> int:
    """A port of ``ports`` that 127.0.0.1 can bind now, tried at random (as Prefect does: two
    commands starting at once rarely pick the same one, and uvicorn's exit code 3 covers a
    race).

    Raises:
        RuntimeError: ten tries found none free.
    """
    for _ in range(10):
        port = random.choice(ports)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return port
            except OSError:
                pass
        time.sleep(random.uniform(0.1, 0.5))
    raise RuntimeError(f"no free port for the temporary Prefect server in {ports.start}-{ports.stop - 1}")


def _start(server) -> None:
    """``server.start()``; its time-out error says what to do about it (a busy machine
    starts the server slowly: Prefect's own message names neither the setting nor a way out)."""
    # prefect: 1-2 s to import; only flows and stage runs need it
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    try:
        server.start()
    except RuntimeError as exc:
        if "Timed out" not in str(exc):
            raise
        limit = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
        raise RuntimeError(
            f"the temporary Prefect server did not answer within {limit:g} s "
            f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS): on a busy machine set it higher, or start "
            f"a server once (`prefect server start`) and set PREFECT_API_URL=http://127.0.0.1:4200/api. "
            f"Prefect said: {exc}"
        ) from exc


@contextmanager
def prefect_api() -> Iterator[str]:
    """Make a Prefect API available for the duration of the block; yield its URL.

    A configured ``PREFECT_API_URL`` (a running server or Prefect Cloud) is used as is.
    Otherwise Prefect's temporary server is started in a session of its own on a free
    local port, ``PREFECT_API_URL`` points at it inside the block, and it is stopped when
    the block exits, however it exits.

    Raises:
        RuntimeError: the temporary server did not answer within
            ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` (the message names the
            setting and the two ways out).
    """
    # prefect: 1-2 s to import; only flows and stage runs need it
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    server = TemporaryServer()
    try:
        _start(server)
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
