"""A stage ends with the process that started it: ``posttrain stage`` watches its parent.

``dvc repro`` runs a stage's ``cmd`` as ``$SHELL -c CMD`` (``/bin/sh -c CMD`` when SHELL is
unset; no ``shell=True``) and waits for it. bash execs a lone command, so the stage's parent
is dvc itself; dash (Debian's and Ubuntu's ``/bin/sh``) stays in between as the stage's
parent. dvc has no SIGTERM handler and ignores SIGINT while a command runs, so a SIGKILL or
SIGTERM of dvc tells the command nothing: it is re-parented (bash), or keeps a shell that
is waiting for it (dash), and goes on training and publishing on its own. ``make``,
Prefect's shell steps and CI runners start commands the same ways.

:func:`watch_parent` starts a daemon thread that polls the *owners* of this process every
:data:`POLL_S` seconds: its parent and, past each non-interactive shell (``sh -c``,
``bash -c``, ...), that shell's parent, up to the first process that is not such a shell
(:func:`owners`). When one of them has exited (or this process was re-parented), the
thread sends SIGTERM to this process, which then ends as a ``kill`` would end it:
Prefect's flow engine marks the flow run Crashed and the process exits; the reaper
(tasks/reaper.py) ends what the stage started (Ray, vLLM, W&B); nothing is published
(the publish is the stage's last step, and atomic), and the checkpoint of the attempt
stays for the next run to resume from. If the process is still alive :data:`GRACE_S`
seconds later (the main thread stuck in a long native call, which delays Python's signal
handlers), the thread sends SIGKILL; the reaper still ends the children.

``POSTTRAIN_PARENT_WATCH=0`` turns the watch off, for a stage meant to outlive what started
it (``nohup posttrain stage ... &`` from a terminal you then close).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import psutil

ENV = "POSTTRAIN_PARENT_WATCH"
POLL_S = 0.5
GRACE_S = 10.0
SHELLS = frozenset({"sh", "ash", "dash", "bash", "zsh", "ksh", "mksh", "fish", "busybox"})


def is_command_shell(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a shell running a command string (``sh -c CMD``, ``bash
    --norc -c CMD``, ``sh -ec CMD``): a wrapper that lives exactly as long as the command
    it started, unlike an interactive shell. False if the process is gone or unreadable."""
    try:
        name, cmdline = proc.name(), proc.cmdline()
    except psutil.Error:
        return False
    flags = [a for a in cmdline[1:] if a.startswith("-") and not a.startswith("--")]
    return os.path.basename(name) in SHELLS and any("c" in f[1:] for f in flags)


def owners(pid: int | None = None) -> list[psutil.Process]:
    """The processes whose exit ends process ``pid`` (default: this one), nearest first: its
    parent and, while the last one is a command shell (:func:`is_command_shell`), that
    shell's parent. Under ``dvc repro`` that is ``[dvc]`` (bash) or ``[sh, dvc]`` (dash).
    Empty when the parent is pid 1 (started detached). Raises psutil.NoSuchProcess if
    ``pid`` does not exist."""
    chain: list[psutil.Process] = []
    proc = psutil.Process(pid if pid is not None else os.getpid()).parent()
    while proc is not None and proc.pid > 1:
        chain.append(proc)
        if not is_command_shell(proc):
            break
        try:
            proc = proc.parent()
        except psutil.Error:
            break
    return chain


def _gone(proc: psutil.Process) -> bool:
    """Exited: no such process any more, its pid reused (psutil compares create times), or
    a zombie its own parent has not reaped yet."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.name()} (pid {proc.pid})"
    except psutil.Error:
        return f"pid {proc.pid}"


def _watch(chain: list[tuple[psutil.Process, str]], ppid: int, poll_s: float, grace_s: float) -> None:
    while True:
        dead = next((what for p, what in chain if _gone(p)), None)
        if dead is not None or os.getppid() != ppid:
            break
        time.sleep(poll_s)
    what = dead or f"the parent (pid {ppid})"
    try:
        print(
            f"posttrain: {what}, which started this stage, has exited; stopping the stage as SIGTERM would "
            "(nothing is published; its checkpoint is kept for the next run)",
            file=sys.stderr,
            flush=True,
        )
    except (OSError, ValueError):  # stderr may be a closed pipe once the parent is gone
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


def watch_parent(poll_s: float = POLL_S, grace_s: float = GRACE_S) -> threading.Thread | None:
    """Start the daemon thread that ends this process once one of its :func:`owners` exits:
    SIGTERM to itself, then SIGKILL if it is still alive ``grace_s`` seconds later (see the
    module docstring). ``poll_s``: seconds between checks. Returns the thread, or None when
    there is nothing to watch (the parent is pid 1) or ``POSTTRAIN_PARENT_WATCH=0``."""
    if os.environ.get(ENV, "1").strip() == "0":
        return None
    ppid = os.getppid()
    try:
        chain = owners()
    except psutil.Error:
        return None
    if not chain:
        return None
    described = [(p, _describe(p)) for p in chain]  # named now: a dead process has no name
    thread = threading.Thread(
        target=_watch, args=(described, ppid, poll_s, grace_s), name="posttrain-parent-watch", daemon=True
    )
    thread.start()
    return thread
