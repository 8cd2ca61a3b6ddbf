"""``posttrain push``: the export directory as it is, a dry run, and the lines before and after a
failed network call. A real upload to the Hugging Face Hub is not exercised here (no network, no
token): create_repo + upload_folder run only against a local endpoint that refuses connections."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[2]
CARD = "---\nlicense: apache-2.0\ntags:\n- posttrain\n---\n# tiny policy\n"


def _push(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full.update(PYTHONPATH=str(REPO), HF_HOME=str(cwd / "hf-home"), **env)  # no token stored there
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "push", *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture()
def export_with_card(tiny_chat_artifacts, tmp_path) -> Path:
    """A copy of the export artifact whose hf_model/ holds a model card (as the export stage will write it)."""
    copy = tmp_path / "export"
    shutil.copytree(tiny_chat_artifacts["export"]["dir"], copy)
    (copy / "hf_model" / "README.md").write_text(CARD)
    return copy


@pytest.fixture()
def recording_endpoint():
    """A local HTTP endpoint that records every request it gets (and answers 500)."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _record(self):
            seen.append(f"{self.command} {self.path}")
            self.send_response(500)
            self.end_headers()

        do_GET = do_POST = do_PUT = do_HEAD = _record

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", seen
    server.shutdown()


def test_dry_run_lists_exactly_the_export_directory_and_the_cards_header(export_with_card, tmp_path):
    proc = _push([str(export_with_card), "--repo", "my-org/tiny-policy", "--dry-run", "--private"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    listed = [line.split()[0] for line in lines if line.startswith("  ")]
    hf_model = export_with_card / "hf_model"
    assert listed == sorted(p.relative_to(hf_model).as_posix() for p in hf_model.rglob("*") if p.is_file())
    assert "README.md" in listed and "model.safetensors" in listed and "manifest.json" not in listed
    assert lines[0].startswith(f"would upload {len(listed)} files (") and lines[0].endswith(
        " to my-org/tiny-policy (private):"
    )
    assert (
        proc.stdout.split("model card header (README.md):\n")[1]
        == "---\nlicense: apache-2.0\ntags:\n- posttrain\n---\n"
    )


def test_without_a_token_one_line_and_no_request(export_with_card, tmp_path, recording_endpoint):
    endpoint, seen = recording_endpoint
    proc = _push([str(export_with_card), "--repo", "my-org/tiny-policy"], tmp_path, HF_ENDPOINT=endpoint)
    assert proc.returncode == 2
    assert proc.stdout.strip() == (
        "error: no Hugging Face token: set HF_TOKEN (a write token from "
        "https://huggingface.co/settings/tokens) or run `hf auth login`"
    )
    assert seen == []


def test_offline_mode_is_one_line_before_any_request(export_with_card, tmp_path, recording_endpoint):
    endpoint, seen = recording_endpoint
    proc = _push(
        [str(export_with_card), "--repo", "my-org/tiny-policy"],
        tmp_path,
        HF_ENDPOINT=endpoint,
        HF_HUB_OFFLINE="1",
        HF_TOKEN="hf_not_a_real_token",
    )
    assert proc.returncode == 2
    assert proc.stdout.strip() == (
        "error: HF_HUB_OFFLINE is set: push needs the network; unset HF_HUB_OFFLINE "
        "(or use --dry-run to list the files)"
    )
    assert seen == []


def test_an_unreachable_endpoint_is_one_line_naming_it(export_with_card, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    proc = _push(
        [str(export_with_card), "--repo", "my-org/tiny-policy"],
        tmp_path,
        HF_ENDPOINT=endpoint,
        HF_TOKEN="hf_not_a_real_token",
    )
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == [
        f"error: upload to {endpoint} (my-org/tiny-policy) failed: ConnectError: [Errno 111] Connection refused"
    ]


def test_push_takes_only_an_export_and_a_well_formed_repo(tiny_chat_artifacts, tmp_path):
    proc = _push([str(tiny_chat_artifacts["rl"]["dir"]), "--repo", "my-org/tiny-policy", "--dry-run"], tmp_path)
    assert proc.returncode == 2
    assert "is an artifact of stage rl; this needs one of stage export" in proc.stdout
    proc = _push([str(tiny_chat_artifacts["export"]["dir"]), "--repo", "tiny-policy", "--dry-run"], tmp_path)
    assert proc.returncode == 2
    assert proc.stdout.strip() == "error: --repo 'tiny-policy': expected ORG/NAME (letters, digits, '-', '_', '.')"
