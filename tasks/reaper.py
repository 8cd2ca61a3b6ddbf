"""Children die with their stage: a reaper process that ends what a dead stage process left running.

A stage process starts processes it does not control: W&B's writer (``wandb-core``), Ray's
local cluster, Prefect's temporary server, and any ``spawn`` multiprocessing child a library
or a reward plug-in starts, with Python's resource tracker (both started through
``_posixsubprocess.fork_exec``, so no at-fork hook can set ``PR_SET_PDEATHSIG`` in them;
megatron-core's torch_dist writer would start a manager, engine/storage/torch_dist.py
gives it an in-process queue instead). When the
stage process is killed outright (SIGKILL, the OOM killer) nothing in it runs to stop them.

:func:`ensure_reaper` starts one small process per stage process (``python -m
tasks.reaper``) in a session of its own. It holds the read end of a pipe whose write end only
the stage process holds, and every 0.5 s records the stage process's descendants
(psutil: pid and create time, so a recycled pid is never signalled). When the pipe reports
EOF and the reaper is re-parented (the stage process is gone, however it went), the reaper:

1. sends SIGTERM to everything it recorded that is still alive, to their current children,
   and to every process whose environment carries this reaper's token (started by the
   stage process after the reaper, but missed by the last snapshot);
2. sends SIGKILL to what is left after a grace: 5 s for W&B processes (:func:`is_wandb`:
   ``wandb-core`` and the like; it does not flush on SIGTERM, which is why stage runs
   flush every second, tasks/tracking.py), 2 s for the rest, and 1 s more
   for Python's resource trackers (they ignore SIGTERM and, once every process holding
   their pipe is gone, remove the semaphores and shared memory the dead processes leaked);
3. exits.

The stage ending normally is the same event (the pipe closes when the process exits):
whatever it left running is ended the same way, and the reaper exits. Killing the reaper
harms nothing: the stage process never writes to the pipe, and keeps running;
:func:`ensure_reaper` starts a new reaper the next time it is called.

Ray fate-shares its local cluster with the driver: raylet, gcs_server and the workers die
within about a second of it. Its dashboard and runtime-env agents outlive it by a minute or
two; the reaper ends them with everything else. While the stage process lives the reaper
touches nothing.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

TOKEN_ENV = "POSTTRAIN_REAPER_TOKEN"
POLL_S = 0.5
GRACE_S = 2.0
WANDB_GRACE_S = 5.0
TRACKER_EXTRA_S = 1.0
_GIVE_UP_S = 3.0  # after the last SIGKILL: stop waiting for processes that do not go away
_MAX_REAP_S = 30.0  # however many processes keep appearing

_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class _Reaper:
    owner: int  # pid of the process that started it
    proc: subprocess.Popen
    write_fd: int
    token: str


_lock = threading.Lock()
_reaper: _Reaper | None = None


def _forget_in_child() -> None:
    """After ``os.fork`` in the child: the parent's reaper is not this process's reaper, and the
    child must not hold the parent's pipe open (the parent's death would go unnoticed)."""
    global _reaper, _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _reaper is not None:
        try:
            os.close(_reaper.write_fd)
        except OSError:
            pass
        _reaper = None


os.register_at_fork(after_in_child=_forget_in_child)


def ensure_reaper() -> None:
    """Make sure this process has a reaper: the first call starts one, later calls do nothing
    while it lives (a killed reaper is replaced). A child created by ``os.fork`` has no reaper
    until it calls this itself.

    Raises:
        OSError: the reaper process could not be started (no ``python``, no file descriptors).
    """
    global _reaper
    with _lock:
        current = _reaper
        if current is not None and current.owner == os.getpid() and current.proc.poll() is None:
            return
        if current is not None and current.owner == os.getpid():
            os.close(current.write_fd)  # the reaper was killed; its pipe is useless
        _reaper = None
        token = uuid.uuid4().hex
        read_fd, write_fd = os.pipe()  # both ends close-on-exec: no exec'd child inherits them
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tasks.reaper",
                    "--fd",
                    str(read_fd),
                    "--pid",
                    str(os.getpid()),
                    "--token",
                    token,
                ],
                cwd=_ROOT,  # `-m tasks.reaper` resolves from here, whatever the stage's working directory
                pass_fds=(read_fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C or killpg of the stage's group does not reach it
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        os.environ[TOKEN_ENV] = token  # children started from now on carry it
        _reaper = _Reaper(os.getpid(), proc, write_fd, token)


def reaper_pid() -> int | None:
    """Pid of this process's live reaper, or None (never started, killed, or this process is a
    fork of the one that started it)."""
    current = _reaper
    if current is None or current.owner != os.getpid() or current.proc.poll() is not None:
        return None
    return current.proc.pid


# ----------------------------------------------------------------------------- the reaper process


def is_wandb(name: str, cmdline: list[str]) -> bool:
    """Whether a process (its name and command line) is one of W&B's: the program is named so
    (``wandb-core``, ``wandb-symon``) or it runs W&B's Python package (``-m wandb...`` or a
    file inside the installed ``wandb`` package). A data path that merely mentions W&B
    (``--dir=/runs/wandb``) does not count."""
    program = Path(cmdline[0]).name if cmdline else ""
    if "wandb" in name.lower() or "wandb" in program.lower():
        return True
    return any(part == "wandb" or part.startswith("wandb.") or "-packages/wandb/" in part for part in cmdline[1:])


def _is_wandb(proc) -> bool:
    try:
        return is_wandb(proc.name(), proc.cmdline())
    except psutil.Error:  # gone, or not ours to read
        return False


def _is_tracker(proc) -> bool:
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def _alive(proc) -> bool:
    """Running and not a zombie; False for a recycled pid (psutil compares create times)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _record(tracked: dict, proc) -> None:
    try:
        tracked.setdefault((proc.pid, proc.create_time()), proc)
    except psutil.Error:
        pass


def _snapshot(stage, tracked: dict, me: int) -> None:
    """Add the stage process's current descendants to ``tracked``; drop the ones that ended."""
    try:
        children = stage.children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        if child.pid != me:
            _record(tracked, child)
    for key in [k for k, p in tracked.items() if not _alive(p)]:
        del tracked[key]


def _carriers(token: str, me: int) -> list:
    """Processes whose environment holds ``token``: started by the stage process after its reaper."""
    found = []
    needle = f"{TOKEN_ENV}={token}".encode()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(proc)
        except OSError:
            continue
    return found


def _with_children(tracked: dict, me: int) -> None:
    for proc in list(tracked.values()):
        try:
            children = proc.children(recursive=True)
        except psutil.Error:
            continue
        for child in children:
            if child.pid != me:
                _record(tracked, child)


def reap(tracked: dict, me: int, token: str | None = None) -> None:
    """End every live process of ``tracked`` (``{(pid, create_time): psutil.Process}``), their
    children, and the processes carrying ``token``: SIGTERM, then SIGKILL after each one's
    grace (see the module docstring). Returns when all are gone or a few seconds after the
    last SIGKILL. Never raises for processes that ended or are not ours to signal."""
    if token:
        for proc in _carriers(token, me):
            _record(tracked, proc)
    _with_children(tracked, me)
    start = time.monotonic()
    deadlines: dict[tuple, float] = {}
    signalled: set[tuple] = set()
    while True:
        _with_children(tracked, me)  # a SIGTERM handler may start processes of its own
        live = {k: p for k, p in tracked.items() if _alive(p)}
        if not live:
            return
        now = time.monotonic()
        for key, proc in live.items():
            if key not in deadlines:
                grace = WANDB_GRACE_S if _is_wandb(proc) else GRACE_S + (TRACKER_EXTRA_S if _is_tracker(proc) else 0.0)
                deadlines[key] = now + grace
            try:
                if key not in signalled:
                    signalled.add(key)
                    proc.terminate()
                elif now >= deadlines[key]:
                    proc.kill()
            except psutil.Error:
                pass
        if now > max(deadlines.values()) + _GIVE_UP_S or now - start > _MAX_REAP_S:
            return
        time.sleep(0.1)


def _watch(read_fd: int, stage_pid: int, token: str) -> None:
    """Snapshot the stage process's descendants every POLL_S until it is gone, then reap.

    Gone means this process was re-parented (the kernel does that as the stage process
    exits, however it exits). EOF on the pipe comes first, at the exit itself, and only makes
    the check frequent: a stage process that closed the pipe and lives on (an ``exec``, a
    library closing every descriptor) keeps its children.
    """
    me = os.getpid()
    tracked: dict = {}
    try:
        stage = psutil.Process(stage_pid)
    except psutil.Error:
        stage = None
    eof_at = None
    last_snapshot = float("-inf")
    while stage is not None and os.getppid() == stage_pid:
        now = time.monotonic()
        if now - last_snapshot >= POLL_S:
            _snapshot(stage, tracked, me)
            last_snapshot = now
        if eof_at is None:
            ready, _, _ = select.select([read_fd], [], [], POLL_S)
            if ready and not os.read(read_fd, 4096):
                eof_at = time.monotonic()
                os.close(read_fd)
        else:
            time.sleep(0.02 if now - eof_at < 5.0 else POLL_S)
    reap(tracked, me, token)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tasks.reaper --fd N --pid P --token T`` (started by
    :func:`ensure_reaper`, not by hand). Returns 0 once the stage process is gone and reaped."""
    parser = argparse.ArgumentParser(prog="python -m tasks.reaper", description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="read end of the stage process's pipe")
    parser.add_argument("--pid", type=int, required=True, help="the stage process")
    parser.add_argument("--token", required=True, help=f"value of {TOKEN_ENV} in the stage process")
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    _watch(args.fd, args.pid, args.token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
