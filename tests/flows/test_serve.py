"""``posttrain serve``: vLLM's OpenAI-compatible server for an export artifact named by its id. A
chat completion (temperature 0) equals the greedy response of the evaluate stage's engine
(build_rollout_engine + data.chat.encode_prompt, as engine.evaluation.scoring runs them); the
server's process group is gone after SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "What is 12 + 35?"}]
MAX_NEW = 8


def _evaluate_engines_reply(hf_dir: Path) -> str:
    from transformers import AutoTokenizer

    from data.chat import encode_prompt
    from engine.evaluation.scoring import decode_response
    from engine.rollout.base import SamplingSpec
    from engine.rollout.factory import build_rollout_engine

    tok = AutoTokenizer.from_pretrained(hf_dir)
    engine = build_rollout_engine(
        "vllm", hf_dir, what="evaluate.backend", tokenizer=tok, num_sequences=1, max_model_len=128, precision="fp32"
    )
    spec = SamplingSpec(n=1, temperature=0.0, top_p=1.0, max_new_tokens=MAX_NEW, seed=0)
    output = engine.generate([encode_prompt(tok, MESSAGES)], spec)[0][0]
    return decode_response(tok, output)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_as_the_evaluate_engine_under_the_artifact_id(tiny_chat_artifacts, tmp_path):
    export = tiny_chat_artifacts["export"]
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "serve",
            export["id"],
            "--artifact-root",
            str(tiny_chat_artifacts["store"]),
            "--port",
            str(port),
            "--precision",
            "fp32",
            "--max-num-seqs",
            "2",
        ],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                models = httpx.get(f"{base}/models", timeout=5)
                if models.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert [m["id"] for m in models.json()["data"]] == [export["id"]]
        reply = httpx.post(
            f"{base}/chat/completions",
            timeout=120,
            json={"model": export["id"], "messages": MESSAGES, "temperature": 0, "max_tokens": MAX_NEW},
        ).json()
        assert reply["model"] == export["id"]
        expected = _evaluate_engines_reply(export["dir"] / "hf_model")
        assert expected and reply["choices"][0]["message"]["content"] == expected
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    # the server's own processes (API server, engine core) went with it
    deadline = time.monotonic() + 30
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "processes of posttrain serve outlived it"
        time.sleep(0.5)
