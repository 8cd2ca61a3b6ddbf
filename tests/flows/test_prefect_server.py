"""The temporary Prefect server of CLI commands: its own session, stopped after the block,
and not started at all when an API is configured."""

from __future__ import annotations

import os
import urllib.request

from prefect import flow
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.prefect_server import prefect_api


@flow
def _add(a: int, b: int) -> int:
    return a + b


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


def test_configured_api_is_used_as_is():
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        with prefect_api() as url:
            assert url == "http://127.0.0.1:9/api"  # nothing started, nothing contacted
