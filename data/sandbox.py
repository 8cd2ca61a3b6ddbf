"""A sandbox that runs model-written Python against one test: :func:`run_test`.

Each test is one fresh process tree, started as follows (what is used is decided once per
process by :func:`sandbox_support` and reported by it):

- ``uid`` (the product runs as root): ``unshare --net --pid --fork --kill-child --mount-proc``,
  then ``setpriv`` to a throwaway uid/gid (random, above 10**6, no groups, no capabilities).
  The program cannot signal or trace the product's processes, cannot read or write files the
  product user owns unless they are world-readable / world-writable, sees only its own
  processes in ``/proc``, and has no network (a new network namespace holds only a down
  loopback: ``connect`` fails with ENETUNREACH).
- ``userns`` (not root, unprivileged user namespaces allowed): ``unshare --user
  --map-root-user --net --pid --fork --kill-child --mount-proc``. The same, except that the
  program's files are the product user's: it can write where the product user can.
- ``process`` (no ``unshare``, or the kernel refuses namespaces): a plain child in its own
  session. No network isolation (``sandbox_support().network`` is False and says why), and a
  grandchild that calls ``setsid`` escapes the process-group kill.

Everywhere: ``python -I`` (no PYTHON* variables, no user site), an environment of only
``HOME``/``TMPDIR`` (the temporary directory), ``PATH`` and ``LANG``; cwd and HOME a fresh
temporary directory, removed afterwards; rlimits set by the runner before the program runs:
RLIMIT_CPU (``cpu_s``, a SIGXCPU handler ends the run), RLIMIT_AS (``memory_mb``), RLIMIT_NPROC
(``max_processes``; in the namespaced modes it counts only the sandbox's own processes: a fresh
uid, or a fresh user namespace whose process count starts at 0 (Linux >= 5.14 counts
RLIMIT_NPROC per user namespace); in ``process`` mode it is the user's current count plus
``max_processes``), RLIMIT_FSIZE (``max_file_mb``), RLIMIT_CORE 0. The parent enforces the wall
limit (``wall_s``) and the output limit (``max_output_bytes`` of stdout, the same of stderr),
then kills the process tree: the pid namespace's init (so every process of the namespace, even
one that left the process group) and the process group.

A verdict is trusted only when the runner writes it with a per-run random nonce to a pipe
after the test code has finished: ``sys.exit(0)`` or ``os._exit(0)`` before the asserts ran
is an error, not a pass. The nonce lives in the runner's memory, so a program that walks the
interpreter's frames can forge a pass: the sandbox contains damage; it does not make reward
hacking by introspection impossible.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

STATUSES = ("passed", "failed", "timeout", "error")
_MARK = "posttrain-sandbox"  # in every runner's command line, so a leftover process is findable


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one test run. Units: seconds, MiB, bytes, processes."""

    wall_s: float = 10.0  # wall clock of the whole test, start-up included
    cpu_s: float = 10.0  # RLIMIT_CPU of each process (integer seconds, rounded up)
    memory_mb: int = 1024  # RLIMIT_AS (address space) of each process
    max_processes: int = 16  # RLIMIT_NPROC: processes the program may have at once, runner included
    max_output_bytes: int = 1 << 20  # of stdout (and, separately, of stderr)
    max_file_mb: int = 16  # RLIMIT_FSIZE: the largest file the program may write

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "max_processes", "max_output_bytes", "max_file_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class CaseResult:
    """One test's outcome: ``status`` in :data:`STATUSES`, ``reason`` ('' when passed), the
    program's stdout (up to the limit) and the wall seconds it took."""

    status: str
    reason: str = ""
    stdout: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(frozen=True)
class SandboxSupport:
    """What :func:`run_test` can use here: ``mode`` (``uid`` | ``userns`` | ``process``, see
    the module docstring), whether the program is cut off from the network, and why not."""

    mode: str
    network: bool
    reason: str


# ----------------------------------------------------------------------------- the runner

# Runs inside the sandbox as `python -I -c RUNNER`. stdin: b"<n>\n" + n bytes of JSON payload
# {program, test, nonce, limits}, then the program's own stdin. Verdict: one JSON line on the
# inherited pipe whose number the payload's "fd" gives.
RUNNER = r"""# posttrain-sandbox runner
import json, os, resource, signal, sys, traceback
def _read(n):
    out = b""
    while len(out) < n:
        chunk = os.read(0, n - len(out))
        if not chunk:
            break
        out += chunk
    return out
head = b""
while not head.endswith(b"\n"):
    c = os.read(0, 1)
    if not c:
        break
    head += c
_p = json.loads(_read(int(head)))
_nonce, _test, _fd = _p.pop("nonce"), _p.pop("test"), _p.pop("fd")
def _verdict(status, reason=""):
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    try:
        os.write(_fd, (json.dumps({"nonce": _nonce, "status": status, "reason": reason[-2000:]}) + "\n").encode())
    except OSError:
        pass
    os._exit(0)
_cpu = _p["limits"]["RLIMIT_CPU"]
signal.signal(signal.SIGXCPU, lambda *a: _verdict("timeout", "CPU time over %d s" % _cpu))
for _name, _value in _p.pop("limits").items():
    _hard = _value + 1 if _name == "RLIMIT_CPU" else _value
    resource.setrlimit(getattr(resource, _name), (_value, _hard))
_g = {"__name__": "__main__", "__builtins__": __builtins__}
def _where(exc):
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<test>"]
    lines = _test.splitlines()
    return lines[frames[-1].lineno - 1].strip() if frames and 0 < (frames[-1].lineno or 0) <= len(lines) else ""
try:
    exec(compile(_p.pop("program"), "<solution>", "exec"), _g)
    if _test is not None:
        exec(compile(_test, "<test>", "exec"), _g)
except AssertionError as e:
    line = _where(e)
    msg = "".join(traceback.format_exception_only(e)).strip()
    _verdict("failed", (line + ": " if line else "") + msg)
except MemoryError:
    _verdict("error", "killed: memory")
except SystemExit as e:
    if _test is None and e.code in (0, None):
        _verdict("ran")
    _verdict("error", "exit(%r) before the tests finished" % (e.code,))
except SyntaxError as e:
    _verdict("error", "%s: %s (%s, line %s)" % (type(e).__name__, e.msg, e.filename, e.lineno))
except BaseException as e:
    _verdict("error", "".join(traceback.format_exception_only(e)).strip().splitlines()[-1])
_verdict("passed" if _test is not None else "ran")
"""


# ----------------------------------------------------------------------------- support probe


def _probe(cmd: list[str]) -> str | None:
    """None when ``cmd`` runs a Python that finds no route to the network, else why not."""
    code = (
        "import socket\ns = socket.socket()\ns.settimeout(1)\n"
        "try:\n    s.connect(('127.0.0.1', 9))\nexcept OSError as e:\n    print(e.errno)\n"
    )
    try:
        done = subprocess.run(
            cmd + [sys.executable, "-I", "-c", code],
            capture_output=True,
            text=True,
            timeout=30,
            env=_env(tempfile.gettempdir()),
            cwd=tempfile.gettempdir(),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(cmd[:2])} failed: {exc}"
    if done.returncode != 0:
        return f"{' '.join(cmd[:2])} exited {done.returncode}: {done.stderr.strip()[-300:]}"
    if done.stdout.strip() != str(errno.ENETUNREACH):
        return f"the namespace still reaches the network (connect gave errno {done.stdout.strip()})"
    return None


def _unshare_cmd(mode: str, uid: int = 0) -> list[str]:
    ns = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if mode == "uid":
        return ["unshare", *ns, "--", "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return ["unshare", "--user", "--map-root-user", *ns, "--"]


@functools.cache
def sandbox_support() -> SandboxSupport:
    """How this machine isolates a sandboxed program (probed once per process: about 0.1 s).

    Tries, in order, ``uid`` (only as root) and ``userns``; each must start the interpreter
    and leave it unable to reach 127.0.0.1. Otherwise ``process`` with ``network`` False and
    the reason (``unshare`` missing, ``kernel.unprivileged_userns_clone`` 0, a container
    without CAP_SYS_ADMIN, ...).
    """
    if shutil.which("unshare") is None:
        return SandboxSupport("process", False, "no unshare binary (util-linux) on PATH")
    reasons = []
    modes = (["uid"] if os.geteuid() == 0 and shutil.which("setpriv") else []) + ["userns"]
    for mode in modes:
        why = _probe(_unshare_cmd(mode, _throwaway_uid()))
        if why is None:
            return SandboxSupport(mode, True, "")
        reasons.append(f"{mode}: {why}")
    return SandboxSupport("process", False, "no network namespace: " + "; ".join(reasons))


def network_isolation_problem() -> str | None:
    """None when sandboxed programs have no network, else one sentence why (for ``posttrain validate``)."""
    support = sandbox_support()
    return None if support.network else support.reason


# ----------------------------------------------------------------------------- one run


def _throwaway_uid() -> int:
    return 1_000_000 + secrets.randbelow(2_000_000_000 - 1_000_000)


def _env(home: str) -> dict[str, str]:
    return {"HOME": home, "TMPDIR": home, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def _user_processes() -> int:
    uid, n = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                n += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return n


class _Reader(threading.Thread):
    """Reads a pipe to EOF, keeping at most ``limit`` bytes; ``over`` once more arrived."""

    def __init__(self, fd, limit: int, on_over):
        super().__init__(daemon=True)
        self.fd, self.limit, self.on_over = fd, limit, on_over
        self.data, self.over = bytearray(), False

    def run(self):
        try:
            while chunk := self.fd.read1(65536):
                room = self.limit - len(self.data)
                self.data += chunk[: max(room, 0)]
                if len(chunk) > room and not self.over:
                    self.over = True
                    self.on_over()
        except (OSError, ValueError):
            pass


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _kill_tree(proc: subprocess.Popen, mode: str) -> None:
    """SIGKILL the pid namespace's init (its death kills the namespace) and the process group."""
    if mode != "process":
        for child in _children(proc.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _remove(path: str) -> None:
    def unlock(fn, p, exc):  # a directory the program made unwritable
        os.chmod(os.path.dirname(p), 0o700)
        fn(p)

    shutil.rmtree(path, onerror=unlock)


def run_test(
    program: str,
    *,
    test: str | None = None,
    stdin: str = "",
    expected_stdout: str | None = None,
    limits: SandboxLimits = SandboxLimits(),
) -> CaseResult:
    """Run ``program`` then ``test`` (assert mode) or ``program`` on ``stdin`` (stdin/stdout
    mode) in a fresh sandbox; see the module docstring for the isolation.

    Args:
        program: Python source, run as ``__main__``.
        test: Python source run in the program's globals after it (``assert f(2) == 4``, or
            ``check(f)``); passed when it finishes, failed on an AssertionError.
        stdin: the program's standard input (stdin/stdout mode).
        expected_stdout: stdin/stdout mode: passed when the program exits normally (or by
            ``sys.exit(0)``) and its stdout equals this, both compared line by line with
            trailing whitespace stripped and trailing blank lines dropped (APPS/TACO/LiveCodeBench).
        limits: the :class:`SandboxLimits`.

    Returns: a :class:`CaseResult`. ``timeout``: "timed out after X s" (wall) or "CPU time over
    X s"; ``error``: the exception line (``ZeroDivisionError: division by zero``), "killed:
    memory", "output over N bytes", "exit(0) before the tests finished", "exited with status N";
    ``failed``: the failing assert line and exception, or the expected and the actual output.

    Raises:
        ValueError: neither or both of ``test`` and ``expected_stdout``.
    """
    if (test is None) == (expected_stdout is None):
        raise ValueError("run_test: give exactly one of test (assert mode) and expected_stdout (stdin/stdout mode)")
    support = sandbox_support()
    home = tempfile.mkdtemp(prefix=_MARK + "-")
    uid = _throwaway_uid()
    rlimits = {
        "RLIMIT_CPU": max(1, int(-(-limits.cpu_s // 1))),
        "RLIMIT_AS": limits.memory_mb << 20,
        "RLIMIT_FSIZE": limits.max_file_mb << 20,
        "RLIMIT_CORE": 0,
        "RLIMIT_NPROC": limits.max_processes + (_user_processes() if support.mode == "process" else 0),
    }
    if support.mode == "uid":
        os.chown(home, uid, uid)
    os.chmod(home, 0o700)
    nonce = secrets.token_hex(16)
    verdict_r, verdict_w = os.pipe()
    payload = json.dumps(
        {"program": program, "test": test, "nonce": nonce, "limits": rlimits, "fd": verdict_w}
    ).encode()
    data = b"%d\n" % len(payload) + payload + stdin.encode()
    prefix = _unshare_cmd(support.mode, uid) if support.mode != "process" else []
    started = time.monotonic()
    proc = None
    try:
        proc = subprocess.Popen(
            prefix + [sys.executable, "-I", "-c", RUNNER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(verdict_w,),
            cwd=home,
            env=_env(home),
            start_new_session=True,
        )
        os.close(verdict_w)
        verdict_w = -1
        pipe, verdict_r = os.fdopen(verdict_r, "rb"), -1  # _supervise closes it
        return _supervise(proc, support.mode, data, pipe, nonce, expected_stdout, limits, started)
    finally:
        for fd in (verdict_w, verdict_r):
            if fd >= 0:
                os.close(fd)
        if proc is not None:
            _kill_tree(proc, support.mode)
            proc.wait()
        _remove(home)


def _same_output(got: str, expected: str) -> bool:
    """Equal line by line after stripping trailing whitespace, trailing blank lines dropped."""

    def norm(text: str) -> list[str]:
        lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(expected)


def _short(text: str, n: int = 200) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _supervise(proc, mode, data, verdict_pipe, nonce, expected_stdout, limits, started) -> CaseResult:
    """Feed stdin, read the outputs within their limits, wait within ``wall_s``, classify."""
    killed = threading.Event()

    def over():
        killed.set()
        _kill_tree(proc, mode)

    out = _Reader(proc.stdout, limits.max_output_bytes, over)
    err = _Reader(proc.stderr, limits.max_output_bytes, over)
    verdict = _Reader(verdict_pipe, 1 << 16, lambda: None)

    def feed():
        try:
            proc.stdin.write(data)
        except (OSError, ValueError):
            pass
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    threads = [out, err, verdict, threading.Thread(target=feed, daemon=True)]
    for t in threads:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill_tree(proc, mode)  # leftovers of a finished run too (process mode: the group)
    proc.wait()
    for t in threads:
        t.join(timeout=2.0)
    verdict_pipe.close()
    seconds = time.monotonic() - started
    stdout = out.data.decode("utf-8", "replace")
    if out.over or err.over:
        which = "output" if out.over else "stderr"
        return CaseResult("error", f"{which} over {limits.max_output_bytes} bytes", stdout, seconds)
    if timed_out:
        return CaseResult("timeout", f"timed out after {limits.wall_s:g} s", stdout, seconds)
    lines = [line for line in verdict.data.decode("utf-8", "replace").splitlines() if nonce in line]
    found = None
    for line in lines:
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if found.get("nonce") == nonce:
            break
        found = None
    stderr = err.data.decode("utf-8", "replace")
    if found is None:
        if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
            return CaseResult("error", "killed: memory", stdout, seconds)
        tail = stderr.strip().splitlines()[-1:] or [""]
        return CaseResult(
            "error",
            f"exited with status {proc.returncode} before a verdict{': ' + tail[0] if tail[0] else ''}",
            stdout,
            seconds,
        )
    status, reason = found["status"], found["reason"]
    if status == "ran":
        if _same_output(stdout, expected_stdout):
            return CaseResult("passed", "", stdout, seconds)
        return CaseResult("failed", f"expected {_short(expected_stdout)}, got {_short(stdout)}", stdout, seconds)
    return CaseResult(status, reason, stdout, seconds)
