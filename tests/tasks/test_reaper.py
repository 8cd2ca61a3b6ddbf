"""The stage reaper (tasks/reaper.py): whatever a process starts dies when that process dies.

Each test runs a real driver process (a script written to the test's directory) that calls
``ensure_reaper()`` and starts real children: multiprocessing ``spawn`` children (and with
them Python's resource tracker), a plain subprocess, SIGTERM-trapping writers. The test
records the driver's descendants with psutil (pid + create time, so a recycled pid is never
mistaken for a survivor), ends the driver, and polls until they are gone. The end-to-end
test does the same to ``posttrain stage convert`` of the tiny quickstart, killed while its
stage task runs.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from e2e_support import BIN, REPO, env_for, posttrain, tiny_config, write_config

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

Record = tuple[int, float, str]  # pid, create time, command line


# ----------------------------------------------------------------------------- helpers


def descendants(pid: int) -> list[Record]:
    """Live descendants of ``pid``."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                found.append((p.pid, p.create_time(), " ".join(p.cmdline())))
        except psutil.Error:
            pass
    return found


def record_of(pid: int) -> list[Record]:
    """``[(pid, create time, command line)]`` of a live process, ``[]`` if it is gone."""
    try:
        p = psutil.Process(pid)
        return [(pid, p.create_time(), " ".join(p.cmdline()))]
    except psutil.Error:
        return []


def alive(records: list[Record]) -> list[Record]:
    """The records whose process (same pid and create time) still runs and is no zombie."""
    left = []
    for pid, created, cmd in records:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left.append((pid, created, cmd))
        except psutil.Error:
            pass
    return left


def wait_gone(records: list[Record], timeout: float) -> tuple[float, list[Record]]:
    """Poll every 0.1 s until none of ``records`` is alive or ``timeout`` passed; return the
    seconds it took and what is still alive."""
    start = time.monotonic()
    left = alive(records)
    while left and time.monotonic() - start < timeout:
        time.sleep(0.1)
        left = alive(records)
    return time.monotonic() - start, left


def kill_all(records: list[Record]) -> None:
    for pid, _, _ in alive(records):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_lines: dict[int, queue.Queue] = {}


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line the driver prints; fail with its stderr if none comes within ``timeout``."""
    try:
        line = _lines[proc.pid].get(timeout=timeout)
    except queue.Empty:
        line = ""
    if not line:
        proc.kill()
        raise AssertionError(
            f"driver printed nothing within {timeout} s (exit {proc.wait()}): {proc.stderr.read()[-3000:]}"
        )
    return line.strip()


def start_driver(tmp_path: Path, source: str, *args: str) -> subprocess.Popen:
    """Run ``source`` as a script in its own session (stdin/stdout/stderr piped)."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("POSTTRAIN_REAPER_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=env,
        text=True,
        start_new_session=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    lines = _lines[proc.pid] = queue.Queue()

    def pump():  # a thread, not select(): lines already in the pipe's read buffer are never missed
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    return proc


def kinds(records: list[Record]) -> dict[str, int]:
    """How many of ``records`` are reapers, resource trackers and spawn children."""
    count = {"reaper": 0, "tracker": 0, "spawn": 0}
    for _, _, cmd in records:
        if "tasks.reaper" in cmd:
            count["reaper"] += 1
        elif "resource_tracker" in cmd:
            count["tracker"] += 1
        elif "spawn_main" in cmd:
            count["spawn"] += 1
    return count


def tree_of(pid: int, expected: dict[str, int], timeout: float = 15) -> list[Record]:
    """Descendants of ``pid`` once :func:`kinds` of them is ``expected`` (a process just
    started shows an empty command line for a moment); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    records = descendants(pid)
    while kinds(records) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        records = descendants(pid)
    assert kinds(records) == expected, records
    return records


SPAWN_TREE = """
    import multiprocessing as mp
    import sys
    import time

    from tasks.reaper import ensure_reaper, reaper_pid


    def grandchild():
        time.sleep(600)


    def child(ready):
        mp.get_context("spawn").Process(target=grandchild).start()
        ready.set()
        time.sleep(600)


    if __name__ == "__main__":
        if sys.argv[1] == "reaper":
            ensure_reaper()
        ctx = mp.get_context("spawn")
        ready = ctx.Event()  # a semaphore: registered with the resource tracker
        ctx.Process(target=child, args=(ready,)).start()
        assert ready.wait(60)
        print("READY", reaper_pid(), flush=True)
        time.sleep(600)
"""


# ----------------------------------------------------------------------------- unit tests


def test_sigkilled_process_takes_spawn_children_and_resource_tracker_along(tmp_path):
    driver = start_driver(tmp_path, SPAWN_TREE, "reaper")
    records: list[Record] = []
    try:
        reaper = int(read_line(driver, 60).split()[1])
        records = tree_of(driver.pid, {"reaper": 1, "tracker": 1, "spawn": 2})
        assert reaper in {pid for pid, _, _ in records}
        assert psutil.Process(reaper).ppid() == driver.pid
        assert os.getsid(reaper) == reaper  # its own session: a killpg of the driver's group misses it
        driver.kill()  # SIGKILL to the driver alone: its children are not signalled by anyone else
        driver.wait()
        took, left = wait_gone(records, timeout=15)
        assert left == [], f"still alive {took:.1f} s after the SIGKILL: {left}"
    finally:
        kill_all(records)
        driver.kill()


def test_without_reaper_the_same_children_outlive_a_sigkilled_process(tmp_path):
    """The control: the leak the reaper exists for (so the test above can fail)."""
    driver = start_driver(tmp_path, SPAWN_TREE, "none")
    records: list[Record] = []
    try:
        assert read_line(driver, 60) == "READY None"
        records = tree_of(driver.pid, {"reaper": 0, "tracker": 1, "spawn": 2})
        driver.kill()
        driver.wait()
        time.sleep(3)
        assert len(alive(records)) == 3
    finally:
        kill_all(records)
        driver.kill()


def test_normal_exit_ends_leftovers_and_the_reaper(tmp_path):
    source = """
        import multiprocessing as mp
        import subprocess
        import sys

        from tasks.reaper import ensure_reaper, reaper_pid


        def work():
            pass


        if __name__ == "__main__":
            ensure_reaper()
            p = mp.get_context("spawn").Process(target=work)
            p.start()
            p.join()
            orphan = subprocess.Popen(["sleep", "600"])  # started, never waited for
            print("READY", reaper_pid(), orphan.pid, flush=True)
            sys.stdin.read()  # until the test closes our stdin
    """
    driver = start_driver(tmp_path, source)
    records: list[Record] = []
    try:
        _, reaper, orphan = read_line(driver, 60).split()
        records = descendants(driver.pid)
        assert {pid for pid, _, _ in records} >= {int(reaper), int(orphan)}
        driver.stdin.close()  # input() returns: the driver exits normally
        assert driver.wait(timeout=30) == 0
        took, left = wait_gone(records, timeout=10)
        assert left == [], f"still alive {took:.1f} s after a normal exit: {left}"
    finally:
        kill_all(records)
        driver.kill()


WRITER = """
    import signal
    import sys
    import time
    from pathlib import Path

    out = Path(sys.argv[1])


    def flush(signum, frame):
        (out / "term").write_text(str(time.time()))
        time.sleep(3.5)  # longer than the 2 s grace of ordinary processes, shorter than W&B's 5 s
        (out / "flushed").write_text(str(time.time()))
        sys.exit(0)


    signal.signal(signal.SIGTERM, flush)
    (out / "ready").write_text("")
    time.sleep(600)
"""


def test_wandb_writer_gets_sigterm_and_a_longer_grace(tmp_path):
    (tmp_path / "writer.py").write_text(textwrap.dedent(WRITER))
    for name in ("service", "plain"):
        (tmp_path / name).mkdir()
    source = f"""
        import subprocess
        import sys
        import time
        from pathlib import Path

        from tasks.reaper import ensure_reaper

        ensure_reaper()
        here = Path({str(tmp_path)!r})
        # the same script twice; only the first one's argv[0] names W&B, as wandb-core's does
        subprocess.Popen(["bash", "-c", 'exec -a wandb-core "$0" "$@"', sys.executable, str(here / "writer.py"), str(here / "service")])
        subprocess.Popen([sys.executable, str(here / "writer.py"), str(here / "plain")])
        while not all((here / name / "ready").exists() for name in ("service", "plain")):
            time.sleep(0.05)
        print("READY", flush=True)
        time.sleep(600)
    """
    driver = start_driver(tmp_path, source)
    records: list[Record] = []
    try:
        assert read_line(driver, 60) == "READY"
        records = descendants(driver.pid)
        assert sum(cmd.startswith("wandb-core ") for _, _, cmd in records) == 1, records
        killed = time.time()
        driver.kill()
        driver.wait()
        took, left = wait_gone(records, timeout=15)
        assert left == [], f"still alive {took:.1f} s after the SIGKILL: {left}"
        # both got SIGTERM first; only the W&B one had the time to finish its flush
        assert (tmp_path / "service" / "term").exists() and (tmp_path / "plain" / "term").exists()
        assert (tmp_path / "service" / "flushed").exists()
        assert not (tmp_path / "plain" / "flushed").exists()
        term_delay = float((tmp_path / "service" / "term").read_text()) - killed
        assert 0 <= term_delay < 2.0, term_delay  # the reaper polls the pipe; EOF comes at once
    finally:
        kill_all(records)
        driver.kill()


def test_ensure_reaper_is_idempotent_and_fork_safe(tmp_path):
    source = """
        import json
        import os
        import sys
        import time

        import psutil

        from tasks.reaper import ensure_reaper, reaper_pid

        ensure_reaper()
        first = reaper_pid()
        ensure_reaper()
        ensure_reaper()
        # a just-exec'd child's /proc cmdline is empty until the kernel has set its arguments up
        # (after the exec that lets Popen return): wait for every child's to be readable
        deadline = time.monotonic() + 30
        while any(not p.cmdline() for p in psutil.Process().children()) and time.monotonic() < deadline:
            time.sleep(0.05)
        result = {"first": first, "again": reaper_pid(),
                  "reapers": [p.pid for p in psutil.Process().children() if "tasks.reaper" in " ".join(p.cmdline())]}
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            before = reaper_pid()
            ensure_reaper()
            after = reaper_pid()
            os.write(write_end, json.dumps({"before": before, "after": after, "after_ppid": psutil.Process(after).ppid(),
                                            "pid": os.getpid()}).encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as f:
            result["child"] = json.loads(f.read())
        os.waitpid(pid, 0)
        print(json.dumps(result), flush=True)
        sys.stdin.read()
    """
    driver = start_driver(tmp_path, source)
    try:
        result = json.loads(read_line(driver, 60))
        assert result["again"] == result["first"] and result["reapers"] == [result["first"]]
        child = result["child"]
        assert child["before"] is None  # the fork did not inherit the parent's reaper
        assert child["after"] not in (None, result["first"])
        assert child["after_ppid"] == child["pid"]
        took, left = wait_gone(record_of(child["after"]), timeout=10)
        assert left == [], "the forked child's reaper outlived the child"
        assert psutil.Process(result["first"]).is_running()  # the parent's reaper is untouched
    finally:
        driver.kill()


def test_a_killed_reaper_harms_nothing_and_is_replaced(tmp_path):
    source = """
        import sys

        from tasks.reaper import ensure_reaper, reaper_pid

        ensure_reaper()
        print(reaper_pid(), flush=True)
        input()  # the test kills the reaper meanwhile
        print(reaper_pid(), flush=True)
        ensure_reaper()
        print(reaper_pid(), flush=True)
        sys.stdin.read()
    """
    driver = start_driver(tmp_path, source)
    try:
        first = int(read_line(driver, 60))
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while psutil.Process(first).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert read_line(driver, 30) == "None"
        second = int(read_line(driver, 30))
        assert second != first and psutil.Process(second).ppid() == driver.pid
        assert driver.poll() is None  # the driver kept running
        driver.stdin.close()
        assert driver.wait(timeout=30) == 0
        took, left = wait_gone(record_of(second), timeout=10)
        assert left == []
    finally:
        driver.kill()


def test_a_daemon_that_left_the_tree_is_ended_too(tmp_path):
    """A double fork leaves the process tree at once (re-parented to init), so no snapshot of
    descendants sees it; it still carries the reaper's token in its environment."""
    source = """
        import subprocess
        import sys
        import time

        from tasks.reaper import ensure_reaper

        ensure_reaper()
        time.sleep(1.0)  # the reaper is up and snapshotting
        daemon = subprocess.run(["bash", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
        print("READY", daemon.stdout.strip(), flush=True)
        time.sleep(600)
    """
    driver = start_driver(tmp_path, source)
    records: list[Record] = []
    try:
        daemon = int(read_line(driver, 60).split()[1])
        records = record_of(daemon)
        assert records and psutil.Process(daemon).ppid() != driver.pid
        assert daemon not in {pid for pid, _, _ in descendants(driver.pid)}
        driver.kill()
        driver.wait()
        took, left = wait_gone(records, timeout=15)
        assert left == [], f"still alive {took:.1f} s after the SIGKILL: {left}"
    finally:
        kill_all(records)
        driver.kill()


def test_exec_closes_the_pipe_but_the_living_process_keeps_its_children(tmp_path):
    """``exec`` closes the pipe's write end (close-on-exec) while the process lives on under the
    same pid: the reaper must wait for the process itself to die."""
    (tmp_path / "after_exec.py").write_text("import sys\nprint('EXECED', flush=True)\nsys.stdin.read()\n")
    source = f"""
        import os
        import subprocess
        import sys

        from tasks.reaper import ensure_reaper, reaper_pid

        ensure_reaper()
        child = subprocess.Popen(["sleep", "600"])
        print("READY", reaper_pid(), child.pid, flush=True)
        os.execv(sys.executable, [sys.executable, {str(tmp_path / "after_exec.py")!r}])
    """
    driver = start_driver(tmp_path, source)
    records: list[Record] = []
    try:
        _, reaper, child = read_line(driver, 60).split()
        assert read_line(driver, 60) == "EXECED"
        records = record_of(int(reaper)) + record_of(int(child))
        assert len(records) == 2
        time.sleep(2.0)  # > the 0.5 s poll and the 2 s grace: a reaper that took EOF for death would have struck
        assert alive(records) == records
        driver.kill()
        driver.wait()
        took, left = wait_gone(records, timeout=15)
        assert left == [], f"still alive {took:.1f} s after the SIGKILL: {left}"
    finally:
        kill_all(records)
        driver.kill()


@pytest.mark.parametrize(
    "name, cmdline, expected",
    [
        (
            "wandb-core",
            ["/venv/lib/python3.11/site-packages/wandb/bin/wandb-core", "--port-filename", "/tmp/p.txt", "--pid", "7"],
            True,
        ),
        ("wandb-symon", ["/venv/lib/python3.11/site-packages/wandb/bin/wandb-symon", "--portfile", "/tmp/x"], True),
        ("python", ["wandb-core", "writer.py"], True),  # exec -a wandb-core
        ("python3", ["/usr/bin/python3", "-m", "wandb", "sync", "run-1"], True),
        ("python3", ["/usr/bin/python3", "/venv/lib/python3.11/site-packages/wandb/__main__.py"], True),
        ("python", ["/venv/bin/python", "/tmp/test_wandb_grace0/writer.py"], False),
        ("posttrain", ["/venv/bin/python", "/venv/bin/posttrain", "stage", "sft", "--dir=/runs/wandb"], False),
        ("raylet", ["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet"], False),
        ("python", [], False),
    ],
)
def test_is_wandb_names_the_programs_not_the_paths(name, cmdline, expected):
    from tasks.reaper import is_wandb

    assert is_wandb(name, cmdline) is expected


# ----------------------------------------------------------------------------- end to end


def is_wandb_core(cmd: str) -> bool:
    return bool(cmd) and cmd.split()[0].endswith("wandb-core")


def is_prefect_server(cmd: str) -> bool:
    return "prefect.server.api.server:create_app" in cmd


def kill_while_running(
    command: list[str], cwd: Path, env: dict, log: Path, timeout: float = 900
) -> tuple[list[Record], float, list[Record]]:
    """Start ``command`` (a ``posttrain stage convert``), record its descendants every 0.1 s,
    SIGKILL it (the process alone) 0.5 s after its stage task is under way, and wait up to
    20 s for the recorded descendants to go. Returns (recorded, seconds, alive).

    "Under way" is: the stage's W&B writer (``wandb-core``, started when the stage task opens
    its run) and Prefect's temporary server are both running; the reaper started before them."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    records: dict[tuple[int, float], Record] = {}
    running_since = None
    deadline = time.monotonic() + timeout
    try:
        while running_since is None or time.monotonic() - running_since < 0.5:
            if proc.poll() is not None:
                raise AssertionError(
                    f"convert exited ({proc.returncode}) before it was killed\n{log.read_text()[-6000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no W&B writer within {timeout} s\n{log.read_text()[-6000:]}")
            try:
                found = descendants(proc.pid)
            except psutil.NoSuchProcess:
                found = []
            records.update({(pid, created): (pid, created, cmd) for pid, created, cmd in found})
            commands = [cmd for _, _, cmd in found]
            if running_since is None and any(map(is_wandb_core, commands)) and any(map(is_prefect_server, commands)):
                running_since = time.monotonic()
            time.sleep(0.1)
        proc.kill()
        proc.wait()
        recorded = alive(list(records.values()))  # the ones alive at the kill
        took, left = wait_gone(recorded, timeout=20)
        return recorded, took, left
    finally:
        proc.kill()
        proc.wait()
        kill_all(list(records.values()))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tiny quickstart project after ``posttrain stage prepare``, with a Prefect home of its own."""
    work = tmp_path_factory.mktemp("reaper_e2e")
    (work / "prefect_home").mkdir()
    config = write_config(work / "pipeline.yaml", tiny_config(work, **{"rm.enabled": False}))
    env = {**env_for(work), "PREFECT_HOME": str(work / "prefect_home")}
    env.pop("PREFECT_API_URL", None)  # Prefect's temporary server: one more child of the stage
    env.pop("POSTTRAIN_REAPER_TOKEN", None)
    posttrain(["stage", "prepare", str(config)], cwd=work, env=env)
    return work, config, env


@pytest.mark.slow
def test_sigkilled_convert_leaves_nothing_running(prepared):
    work, config, env = prepared
    """The killed stage had started the reaper, W&B's writer and Prefect's temporary server
    (and, its torch_dist saves writing in process, no multiprocessing child); none outlives it."""
    recorded, took, left = kill_while_running(
        [str(BIN / "posttrain"), "stage", "convert", str(config)], work, env, work / "convert.log"
    )
    assert kinds(recorded) == {"reaper": 1, "tracker": 0, "spawn": 0}, recorded
    assert sum(is_wandb_core(cmd) for _, _, cmd in recorded) == 1, recorded
    assert sum(is_prefect_server(cmd) for _, _, cmd in recorded) == 1, recorded
    assert left == [], f"still alive {took:.1f} s after the SIGKILL: {left}"
