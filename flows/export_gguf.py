"""``posttrain export-gguf MODEL_DIR --type q8_0 [--out FILE]``: an HF model directory (an
export artifact's ``hf_model/``) as one GGUF file for llama.cpp and Ollama
(conversion.gguf_export.hf_to_gguf, the function the export stage's ``export.gguf`` uses)."""

from __future__ import annotations

import typing
from pathlib import Path

from rich.console import Console

from config.export import GgufType


def cmd_export_gguf(args, console: Console) -> int:
    """Write the GGUF file; print its path and size. Returns 0; 2 on bad input (the error named)."""
    # torch (via conversion.gguf_export): seconds to import; `posttrain` registers this command on every start
    from conversion.gguf_export import hf_to_gguf

    model_dir = Path(args.model_dir)
    out = Path(args.out) if args.out else Path(f"{model_dir.resolve().name}-{args.type}.gguf")
    try:
        path = hf_to_gguf(model_dir, out, args.type)
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]export-gguf:[/] {e}", highlight=False)
        return 2
    console.print(f"wrote {path} ({path.stat().st_size} bytes, {args.type})", highlight=False)
    return 0


def add_export_gguf_parser(sub, console: Console) -> None:
    """Register ``export-gguf`` on the ``posttrain`` command's subparsers."""
    p = sub.add_parser("export-gguf", help="write an HF model directory as a GGUF file (llama.cpp, Ollama)")
    p.add_argument("model_dir", help="HF model directory, e.g. an export artifact's hf_model/")
    p.add_argument(
        "--type", default="q8_0", choices=list(typing.get_args(GgufType)), help="weight type of the 2-D tensors"
    )
    p.add_argument("--out", help="the .gguf file (default: ./<model_dir name>-<type>.gguf)")
    p.set_defaults(fn=lambda args: cmd_export_gguf(args, console))
