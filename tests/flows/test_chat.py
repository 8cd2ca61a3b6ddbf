"""``posttrain chat`` in a pseudo-terminal: two turns on a converted rl artifact, each streamed reply
equal to transformers' own greedy decoding of the chat-templated conversation, then ``/exit``."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[2]
TURNS = ["What is 12 + 35?", "And 40 + 2?"]
MAX_NEW = 12


def _greedy_replies(hf_dir: Path) -> list[str]:
    """The replies transformers' greedy ``generate`` gives, turn by turn, each turn's prompt the
    tokenizer's chat template over the conversation so far (rendered as text, then tokenized)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    history, replies = [], []
    for turn in TURNS:
        history.append({"role": "user", "content": turn})
        text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        reply = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        replies.append(reply)
        history.append({"role": "assistant", "content": reply})
    return replies


class Terminal:
    """A child process on a pseudo-terminal: what it printed so far, and typing into it."""

    def __init__(self, argv: list[str], env: dict, cwd: Path):
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, start_new_session=True, close_fds=True
        )
        os.close(slave)
        self.output = ""

    def read_until(self, needle: str, start: int, timeout: float) -> int:
        """Read until ``needle`` appears at or after ``start``; returns its index."""
        deadline = time.monotonic() + timeout
        while needle not in self.output[start:]:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not select.select([self.master], [], [], 0)[0]:
                raise AssertionError(
                    f"no {needle!r} after {timeout} s (exit {self.proc.poll()}):\n{self.output[-3000:]}"
                )
            if select.select([self.master], [], [], min(left, 1.0))[0]:
                try:
                    self.output += os.read(self.master, 65536).decode("utf-8", "replace").replace("\r\n", "\n")
                except OSError:  # the child closed the terminal
                    pass
        return self.output.index(needle, start)

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.proc.wait()
        os.close(self.master)


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_chat_streams_the_greedy_replies_of_the_chat_template_and_keeps_the_history(
    backend, tiny_chat_artifacts, tmp_path
):
    expected = _greedy_replies(tiny_chat_artifacts["export"]["dir"] / "hf_model")
    assert expected[0] and expected[0] != expected[1]
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(tmp_path))  # the conversion cache under tmp_path
    term = Terminal(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "chat",
            str(tiny_chat_artifacts["rl"]["dir"]),
            "--backend",
            backend,
            "--precision",
            "fp32",
            "--max-new-tokens",
            str(MAX_NEW),
        ],
        env,
        tmp_path,
    )
    try:
        at = term.read_until("you> ", 0, timeout=240)
        assert f"chatting with {tiny_chat_artifacts['rl']['id']}" in term.output
        for turn, reply in zip(TURNS, expected):
            term.type(turn)
            start = term.read_until("model> ", at, timeout=60) + len("model> ")
            at = term.read_until("\nyou> ", start, timeout=120)
            assert term.output[start:at] == reply
            at += 1
        term.type("/exit")
        assert term.proc.wait(timeout=60) == 0
    finally:
        term.close()
