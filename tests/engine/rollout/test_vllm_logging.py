"""Starting vLLM leaves the process's log handlers alone.

vLLM applies ``logging.config.dictConfig`` when an engine starts, which flushes and closes every
handler the process has; under a Prefect task that includes Prefect's API log handler, and the
run can hang there (its flush waits for a thread that needs logging's lock, which dictConfig
holds). ``engine/rollout/vllm_rollout.py`` turns vLLM's dictConfig off and gives the ``vllm``
logger its own handler. A subprocess: the first engine of a process is the one that configures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[3]

SCRIPT = """
import logging, sys
from pathlib import Path

class Watched(logging.Handler):
    def __init__(self):
        super().__init__()
        self.calls, self.messages = [], []
    def emit(self, record):
        self.messages.append(record.getMessage())
    def flush(self):
        self.calls.append("flush")
    def close(self):
        self.calls.append("close")
        super().close()

watched = Watched()
logging.getLogger().addHandler(watched)
from engine.rollout.base import SamplingSpec
from engine.rollout.vllm_rollout import VLLMRollout
from tests.engine.rollout.test_vllm_rollout import PROMPTS, save_tiny, tiny_qwen2

engine = VLLMRollout(save_tiny(tiny_qwen2(seed=0), Path(sys.argv[1])), num_sequences=3, max_model_len=32)
out = engine.generate(PROMPTS, SamplingSpec(n=1, temperature=0.0, max_new_tokens=4))
logging.getLogger("app").warning("after the engine")
print("CALLS", watched.calls)
print("APP", [m for m in watched.messages if m == "after the engine"])
print("CONFIGURE", engine.llm.llm_engine.vllm_config.logging_config.configure_logging)
print("ROOT_HANDLERS", [type(h).__name__ for h in logging.getLogger().handlers])
vllm_logger = logging.getLogger("vllm")
print("VLLM_LOGGER", [(type(h).__name__, h.stream is sys.stdout) for h in vllm_logger.handlers],
      logging.getLevelName(vllm_logger.level), vllm_logger.propagate)
print("RESPONSES", [len(o[0].token_ids) for o in out])
"""


def test_vllm_start_neither_flushes_nor_closes_the_process_handlers(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_LOGGING_LEVEL", None)  # the default level, whatever the suite's process was given
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "tiny")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout[-3000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    assert "CALLS []" in proc.stdout, output  # vLLM's dictConfig would flush and close it
    assert "APP ['after the engine']" in proc.stdout, output  # still attached and receiving
    assert "CONFIGURE False" in proc.stdout, output
    assert "ROOT_HANDLERS ['Watched']" in proc.stdout, output
    assert "RESPONSES [4, 4, 4]" in proc.stdout, output
    # vLLM's own INFO lines go to its logger's one handler, on stdout, as vLLM's default config
    # would send them; the tokenizer-free engine's warmup warning with its traceback does not print
    assert "VLLM_LOGGER [('StreamHandler', True)] INFO False" in proc.stdout, output
    assert "Chat template warmup failed" not in proc.stdout + proc.stderr, output
