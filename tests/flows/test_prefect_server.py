"""The temporary Prefect server of CLI commands: its own session, stopped after the block,
and not started at all when an API is configured. And the log filter of the long-running
server on SQLite (prefect-server-logging.yml), on real SQLite lock errors."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import sqlalchemy
from prefect import flow
from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_LOG_RETRYABLE_ERRORS, temporary_settings

from flows.prefect_server import RetriedSQLiteLockFilter, TemporaryServer, prefect_api

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[2]


@flow
def _add(a: int, b: int) -> int:
    return a + b


def _server_pids() -> list[int]:
    """Live processes running a Prefect server app (zombies left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode()
                state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if "prefect.server.api.server:create_app" in cmd and state not in "ZX":
                found.append(int(entry))
    return found


def _server_pid(url: str) -> int:
    port = url.rsplit(":", 1)[1].split("/")[0]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "prefect.server.api.server:create_app" in cmd and f"--port {port} " in cmd:
                return int(entry)
    raise AssertionError(f"no server process for {url}")


def test_temporary_server_runs_in_its_own_session_and_stops_after_the_block():
    with prefect_api() as url:
        pid = _server_pid(url)
        assert os.getsid(pid) == pid != os.getsid(0)  # a session leader: Ctrl-C in ours does not reach it
        assert urllib.request.urlopen(f"{url}/health", timeout=10).status == 200
        assert _add(40, 2) == 42  # flows in the block use it
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] in "ZX"


def test_a_server_too_slow_to_start_names_the_setting_and_leaves_nothing_running():
    """A real temporary server given 1 s: it is still importing Prefect when the time is up."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    before = {pid for pid in _server_pids()}
    with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 1}):
        with pytest.raises(RuntimeError) as failed:
            with prefect_api():
                raise AssertionError("the block ran without a server")
    assert str(failed.value).startswith(
        "the temporary Prefect server did not answer within 1 s (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS): "
        "on a busy machine set it higher, or start a server once (`prefect server start`) and set "
        "PREFECT_API_URL=http://127.0.0.1:4200/api. Prefect said: Timed out while attempting to connect"
    )
    assert {pid for pid in _server_pids()} - before == set()  # the server that came up late was stopped


def _listening(port: int) -> bool:
    """Whether a socket listens on 127.0.0.1:``port`` (/proc/net/tcp: state 0A is LISTEN)."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if local == f"0100007F:{port:04X}" and state == "0A":
            return True
    return False


def test_a_health_check_that_times_out_is_waited_out():
    """The server's process is stopped (SIGSTOP) for 7 s the moment it listens: the kernel
    accepts the health check's connection and nothing answers, so the check times out (httpx's
    5 s), as it does on a busy machine. The start waits, and returns once the server answers."""
    server = TemporaryServer()
    stall: dict[str, float] = {}

    def stop_once_listening() -> None:
        while server.server_process is None:
            time.sleep(0.001)
        pid = server.server_process.pid
        while not _listening(server.port):
            time.sleep(0.001)
        os.kill(pid, signal.SIGSTOP)
        stall["from"] = time.monotonic()
        time.sleep(7)
        os.kill(pid, signal.SIGCONT)

    staller = threading.Thread(target=stop_once_listening, daemon=True)
    staller.start()
    try:
        server.start(timeout=120)
        returned = time.monotonic()
        assert urllib.request.urlopen(f"{server.api_url}/health", timeout=10).status == 200
    finally:
        staller.join(timeout=30)
        server.stop()
    assert returned - stall["from"] >= 7  # it waited through the stall instead of failing after 5 s


def test_configured_api_is_used_as_is():
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        with prefect_api() as url:
            assert url == "http://127.0.0.1:9/api"  # nothing started, nothing contacted


# ---------------------------------------------------------------- the server's SQLite retry filter


def _database_locked(tmp_path: Path) -> sqlalchemy.exc.OperationalError:
    """A real "database is locked": SQLAlchemy writing to a SQLite file whose write lock another
    connection holds (timeout 0, so SQLite answers at once, as it does for a deferred upgrade)."""
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    engine = sqlalchemy.create_engine(f"sqlite:///{path}", connect_args={"timeout": 0})
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO t VALUES (1)")
    except sqlalchemy.exc.OperationalError as exc:
        return exc
    finally:
        engine.dispose()
        holder.close()
    raise AssertionError("the write did not fail")


def _kept(records: list[tuple[str, str, BaseException]]) -> list[str]:
    """The messages of the (logger, message, exception) ERROR records the filter keeps."""
    filter_ = RetriedSQLiteLockFilter()
    kept = []
    for name, message, exc in records:
        args = ("12ms", "mark_deployments_ready(...)") if "%s" in message else ()
        record = logging.LogRecord(name, logging.ERROR, __file__, 0, message, args, (type(exc), exc, exc.__traceback__))
        if filter_.filter(record):
            kept.append(f"{name}: {record.getMessage()}")
    return kept


def test_filter_drops_only_retried_sqlite_lock_errors(tmp_path):
    locked = _database_locked(tmp_path)
    assert "database is locked" in str(locked.orig) and locked.orig.sqlite_errorname == "SQLITE_BUSY"
    other = sqlalchemy.exc.OperationalError("SELECT 1", {}, sqlite3.OperationalError("no such table: deployment"))
    validation = "Encountered error during state validation"
    heartbeat = "Worker channel heartbeat persistence failed: work_pool=%s worker_name=%s"
    periodic = "Error running periodic evaluation"
    records = [
        ("docket.dependencies", "↩ [%s] %s", locked),  # dropped: docket retries it
        ("prefect.server", validation, locked),  # dropped: re-raised for a retry
        ("prefect.server.utilities.worker_channel", heartbeat, locked),  # dropped: the worker reconnects
        ("prefect.server.events.triggers", periodic, locked),  # dropped: evaluated again next loop
        ("prefect.server.events.triggers", periodic, other),  # another SQLite error
        ("prefect.server.utilities.worker_channel", heartbeat, other),  # another SQLite error
        ("docket.dependencies", "↩ [%s] %s", other),  # another SQLite error
        ("docket.dependencies", "↩ [%s] %s", ValueError("x")),  # not a database error
        ("docket.dependencies", "❌ [%s] %s", locked),  # not a retry
        ("prefect.server", "Unexpected error in %s: %s", locked),  # not a retried failure
        ("prefect.server.services", validation, locked),  # another logger
    ]
    assert _kept(records) == [
        f"prefect.server.events.triggers: {periodic}",
        "prefect.server.utilities.worker_channel: Worker channel heartbeat persistence failed: "
        "work_pool=12ms worker_name=mark_deployments_ready(...)",
        "docket.dependencies: ↩ [12ms] mark_deployments_ready(...)",
        "docket.dependencies: ↩ [12ms] mark_deployments_ready(...)",
        "docket.dependencies: ❌ [12ms] mark_deployments_ready(...)",
        "prefect.server: Unexpected error in 12ms: mark_deployments_ready(...)",
        f"prefect.server.services: {validation}",
    ]
    with temporary_settings(updates={PREFECT_SERVER_LOG_RETRYABLE_ERRORS: True}):
        assert len(_kept(records)) == len(records)  # Prefect's switch for retryable errors shows them all again


def test_filter_matches_what_docket_and_prefect_log_for_a_retry():
    """The installed pydocket's Retry and Perpetual log a rescheduled failure as "↩ [duration]
    call" on docket.dependencies, and Prefect's orchestration rules log "Encountered error
    during state validation" on prefect.server and re-raise a retryable error: the loggers
    and messages the filter (and prefect-server-logging.yml) name."""
    import docket.dependencies._perpetual as perpetual
    import docket.dependencies._retry as retry
    import prefect.server.api.server  # noqa: F401  (imports the orchestration modules in Prefect's order)
    import prefect.server.orchestration.rules as rules

    for module in (retry, perpetual):
        source = Path(module.__file__).read_text()
        assert 'logger = logging.getLogger("docket.dependencies")' in source and '"↩ [%s] %s",' in source
    source = Path(rules.__file__).read_text()
    assert 'logger: "Logger" = get_logger("server")' in source and rules.logger.name == "prefect.server"
    assert (
        """logger.exception("Encountered error during state validation")
            self.proposed_state: states.State[Any] | None = None

            if is_client_retryable_exception(exc):
                # Do not capture retryable database exceptions, this exception will be
                # raised as a 503 in the API layer
                raise"""
        in source
    )


def test_filter_matches_what_the_worker_channel_logs_for_a_heartbeat_it_retries():
    """Prefect's worker channel logs a heartbeat that failed to persist on its module logger,
    with the message the filter names, and closes the channel with a reason whose policy is
    retryable: the worker's transport reconnects."""
    import prefect.server.utilities.worker_channel as channel
    from prefect.client.schemas.worker_channel import WORKER_CHANNEL_CLOSE_POLICIES, WorkerChannelCloseReason

    source = Path(channel.__file__).read_text()
    assert channel.logger.name == "prefect.server.utilities.worker_channel"
    assert (
        """logger.exception(
                        "Worker channel heartbeat persistence failed: "
"""
        in source
    )
    assert (
        "WorkerChannelCloseReason.HEARTBEAT_PERSISTENCE_FAILED" in source.split("heartbeat persistence failed")[1][:600]
    )
    policy = WORKER_CHANNEL_CLOSE_POLICIES[WorkerChannelCloseReason.HEARTBEAT_PERSISTENCE_FAILED]
    assert policy.retryable and not policy.terminal


def test_filter_matches_what_the_triggers_service_logs_for_a_pass_it_runs_again():
    """Prefect's triggers service logs a failed periodic evaluation on its module logger, with
    the message the filter names, inside a loop that sleeps and evaluates again."""
    import prefect.server.events.triggers as triggers

    source = Path(triggers.__file__).read_text()
    assert triggers.logger.name == "prefect.server.events.triggers"
    assert (
        """    while True:
        try:
            await periodic_evaluation(prefect.types._datetime.now("UTC"))
        except Exception:
            logger.exception("Error running periodic evaluation")
        finally:
            await asyncio.sleep(periodic_granularity.total_seconds())"""
        in source
    )


def test_module_imports_without_prefect():
    """Prefect's logging set-up imports the filter while ``import prefect`` is still running."""
    probe = "import sys, flows.prefect_server; print(sorted(m for m in sys.modules if m.split('.')[0] == 'prefect'))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
