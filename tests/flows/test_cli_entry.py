"""The ``posttrain`` program's end (flows.cli.entry): it ends the process without Python's
finalization, so what finalization would have done for a user must still happen."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A user's process as the console script starts it: an exit handler, a non-daemon thread and
# an idle thread pool (as a library might leave them) are in place before the command runs.
PROGRAM = textwrap.dedent(
    """
    import atexit, gc, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    out = Path(sys.argv[1])

    def handler():
        (out / "handler").write_text(f"{gc.isenabled()} {len(gc.get_objects(generation=2))}")

    def late_thread():
        time.sleep(0.5)
        (out / "thread").write_text("joined")

    atexit.register(handler)
    threading.Thread(target=late_thread).start()
    pool = ThreadPoolExecutor(1)  # its idle worker is a non-daemon thread until told to stop
    pool.submit(int).result()
    sys.stdout.write("x" * 200_000)  # more than a pipe holds: it must be flushed, not dropped
    sys.argv = ["posttrain", *sys.argv[2:]]
    from flows.cli import entry
    entry()
    """
)


def test_entry_exits_with_the_commands_code_after_handlers_threads_and_output(tmp_path):
    missing = tmp_path / "missing.yaml"
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path), "validate", str(missing)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "500", "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr  # a bad config: main's code 2
    assert proc.stdout.startswith("x" * 200_000)
    assert proc.stdout[200_000:].replace("\n", "") == f"error: config file not found: {missing}"
    assert (tmp_path / "thread").read_text() == "joined"  # the thread ran to its end first
    enabled, old = (tmp_path / "handler").read_text().split()
    # the handler ran with the heap frozen: the oldest generation empty, the collector still on
    assert (enabled, old) == ("True", "0")
