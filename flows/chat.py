"""``posttrain chat <artifact|config>``: talk to a trained model in the terminal.

The model is found as :mod:`flows.model_ref` resolves it (any stage's policy; a Megatron
checkpoint is converted to HF once). Each turn is rendered with the model's own chat template
(:func:`data.chat.encode_prompt`, the ids evaluation and RL use) over the whole conversation so
far, optionally after a ``--system`` prompt, and the reply is streamed as it is generated
(:func:`engine.rollout.streaming.stream_text`): on vLLM's in-process engine by default, or on
transformers (``--backend hf``). Greedy by default (``--temperature 0``). ``/exit``, ``/quit``
or end of input (Ctrl-D) ends the chat; ``/reset`` forgets the conversation.
"""

from __future__ import annotations

import json
import os
import sys

from config import ConfigError
from data.chat import encode_prompt
from flows.model_ref import add_model_arguments, find_model_artifact, hf_model_dir

PROMPT = "you> "
REPLY = "model> "


def add_chat_parser(sub) -> None:
    """Register ``posttrain chat`` on the CLI's subparsers ``sub``."""
    p = sub.add_parser("chat", help="chat with a trained model in the terminal (streams its replies)")
    add_model_arguments(p)
    p.add_argument("--backend", choices=("vllm", "hf"), default="vllm", help="generation engine (default: vllm)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="reply length limit in tokens (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (temperature > 0 only)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (each turn adds its index)")
    p.add_argument("--system", default=None, help="a system prompt placed before the conversation")
    p.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="compute precision (auto: bf16 where the hardware has it, as run.precision)",
    )
    p.set_defaults(fn=cmd_chat)


def cmd_chat(args) -> int:
    """Run the chat loop on stdin/stdout. Returns 0 when the user ends it.

    Raises:
        ConfigError: a bad model reference or option (one line naming it and the fix).
    """
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ConfigError(f"--temperature must be >= 0 and --top-p in (0, 1], got {args.temperature} and {args.top_p}")
    artifact = find_model_artifact(args.model, args.overrides, stage=args.stage, artifact_root=args.artifact_root)
    print(f"loading {artifact.name} ({artifact.stage}, {args.backend} backend)...", flush=True)
    os.environ.setdefault(
        "VLLM_LOGGING_LEVEL", "ERROR"
    )  # the engine's INFO and warning lines would interleave with the chat
    hf_dir = hf_model_dir(artifact)
    engine, tokenizer, context = _start_engine(args, hf_dir)
    # torch (via engine.rollout.base, engine.rollout.streaming): seconds to import, not paid until this runs
    from engine.rollout.base import SamplingSpec
    from engine.rollout.streaming import stream_text

    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    print(f"chatting with {artifact.name}; /exit or Ctrl-D ends, /reset forgets the conversation", flush=True)
    for turn in _turns():
        if turn in ("/exit", "/quit"):
            break
        if turn == "/reset":
            history.clear()
            print("(conversation reset)", flush=True)
            continue
        if not turn.strip():
            continue
        messages = [*system, *history, {"role": "user", "content": turn}]
        if tokenizer.chat_template is None:  # plain text continues one user turn only (data.chat.encode_prompt)
            messages = messages[-1:]
        prompt_ids = encode_prompt(tokenizer, messages)
        budget = min(args.max_new_tokens, context - len(prompt_ids))
        if budget < 1:
            print(
                f"(the conversation has {len(prompt_ids)} tokens, the model's context {context}: /reset to start over)",
                flush=True,
            )
            continue
        spec = SamplingSpec(
            n=1,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=budget,
            seed=args.seed + len(history) // 2,
        )
        sys.stdout.write(REPLY)
        pieces = []
        try:
            for piece in stream_text(engine, tokenizer, prompt_ids, spec):
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
            sys.stdout.write(" [stopped]")
        sys.stdout.write("\n")
        sys.stdout.flush()
        history += [{"role": "user", "content": turn}, {"role": "assistant", "content": "".join(pieces)}]
    return 0


def _turns():
    """The user's lines until end of input (readline editing on a terminal)."""
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            print(flush=True)
            return
        except KeyboardInterrupt:
            print(flush=True)
            continue
        yield line.strip()


def _start_engine(args, hf_dir):
    """``(engine, tokenizer, context tokens)`` for ``hf_dir`` on ``args.backend``: the rollout
    engine evaluation builds (engine.rollout.factory), sized for one sequence of the model's
    whole context."""
    # torch (via engine.rollout.factory) and transformers: seconds to import, paid only when chatting
    from transformers import AutoTokenizer

    from engine.models.platform import worker_threads
    from engine.rollout.factory import build_rollout_engine

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    if tokenizer.chat_template is None:
        print(f"note: {hf_dir} has no chat template; each turn continues its own text (no history)", flush=True)
    context = int(json.loads((hf_dir / "config.json").read_text()).get("max_position_embeddings", 2048))
    worker_threads(None)
    engine = build_rollout_engine(
        args.backend,
        hf_dir,
        what="--backend",
        tokenizer=tokenizer,
        num_sequences=1,
        max_model_len=context,
        precision=args.precision,
    )
    return engine, tokenizer, context
