"""Inputs the benchmarks share: the quickstart's prepared data, tokenizer and SFT policy
(made by the ``posttrain`` stages), random-init Qwen2 models of a chosen size, and their
conversion to the RL engine's model directory.

Everything is written under ``work/benchmarks/`` (git-ignored) and reused by later runs:
the stages are cached by fingerprint and the random models are rebuilt only when missing.

Fixed-length generation: the random models have an embedding larger than the tokenizer
(``vocab_size`` = the tokenizer's size rounded up past it to a multiple of 128) and the
engine's model directory names the last, never-sampled id as EOS. The RL engine's vLLM
rollout samples only ids below the tokenizer's size, so its responses always run to
``max_new_tokens``: the engine's equivalent of vLLM's ``ignore_eos``, which its sampling
spec does not expose.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
WORK_DIR = PROJECT_ROOT / "work" / "benchmarks"
QUICKSTART_CONFIG = PROJECT_ROOT / "configs" / "quickstart.yaml"

# Ray starts its worker processes at nice 15 (its ``worker_niceness`` default), so on a shared
# machine the engine's workers yield the CPU to every other process while standalone vLLM and
# TRL run at nice 0. The benchmarks start their Ray clusters with this environment so both
# sides compete for the cores on equal terms; on an otherwise idle machine it changes nothing.
RAY_EQUAL_PRIORITY_ENV = {"RAY_worker_niceness": "0"}


@dataclass(frozen=True)
class Qwen2Shape:
    """A Qwen2 decoder's size (tied embeddings, QKV bias, SwiGLU MLP)."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self, vocab_size: int) -> int:
        """Parameters of a Qwen2 model of this shape with ``vocab_size`` embedding rows and a
        tied output layer: embedding ``V*h``; per layer q/o ``h*h`` each, k/v ``h*kv*d`` each,
        biases on q/k/v, SwiGLU ``3*h*I``, two RMSNorm weights; the final RMSNorm ``h``."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv + (h + 2 * kv)
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        return vocab_size * h + self.num_layers * layer + h


# "0.3m" is the quickstart's shape (hidden 128, 2 layers, head_dim 32) with room for
# 128-token responses; "25m" and "100m" (GPT-2 small's width and depth) have head_dim 64.
# These head sizes are ones vLLM serves on CPU.
SHAPES: dict[str, Qwen2Shape] = {
    "0.3m": Qwen2Shape(128, 2, 4, 2, 256, 256),
    "25m": Qwen2Shape(512, 8, 8, 2, 1536, 256),
    "100m": Qwen2Shape(768, 12, 12, 4, 3072, 256),
}


def padded_vocab_size(num_tokens: int, multiple: int = 128) -> int:
    """The smallest multiple of ``multiple`` strictly above ``num_tokens`` (so at least one
    embedding row is no token of the tokenizer: the unreachable EOS)."""
    return (num_tokens // multiple + 1) * multiple


# ----------------------------------------------------------------------------- the quickstart via posttrain


def quickstart_config(sft_steps: int, root: Path = WORK_DIR) -> dict[str, Any]:
    """``configs/quickstart.yaml`` redirected under ``root`` (its own run name, artifact and
    checkpoint roots, prepared files), W&B off, and ``sft.steps`` set to ``sft_steps``.
    The task, model shape, tokenizer and every other setting are the quickstart's."""
    import yaml

    cfg = yaml.safe_load(QUICKSTART_CONFIG.read_text())
    data_dir = root / "quickstart"
    cfg["run"] = {
        **cfg["run"],
        "name": "bench-quickstart",
        "artifact_root": str(root / "artifacts"),
        "checkpoint_root": str(root / "checkpoints"),
    }
    cfg["wandb"] = {**cfg.get("wandb", {}), "enabled": False}
    cfg["prepare"] = {**cfg["prepare"], "output_dir": str(data_dir)}
    for section in cfg["data"].values():
        if isinstance(section, dict) and "path" in section:
            section["path"] = str(data_dir / Path(section["path"]).name)
    cfg["model"] = {**cfg["model"], "source": str(data_dir / "base_model")}
    cfg["sft"] = {
        **cfg["sft"],
        "steps": sft_steps,
        "checkpoint_every": min(cfg["sft"]["checkpoint_every"], sft_steps),
        "optim": {**cfg["sft"]["optim"], "warmup_steps": min(cfg["sft"]["optim"]["warmup_steps"], sft_steps)},
    }
    return cfg


def write_quickstart_config(sft_steps: int | None, root: Path = WORK_DIR) -> Path:
    """Write :func:`quickstart_config` to ``root/quickstart.yaml`` (validated; ``sft_steps``
    None keeps the quickstart's); returns its path."""
    import yaml

    from config.load import load_config

    root.mkdir(parents=True, exist_ok=True)
    if sft_steps is None:
        sft_steps = int(yaml.safe_load(QUICKSTART_CONFIG.read_text())["sft"]["steps"])
    path = root / "quickstart.yaml"
    path.write_text(yaml.safe_dump(quickstart_config(sft_steps, root), sort_keys=False))
    load_config(path)  # fail here, naming the key, rather than inside a stage
    return path


def run_posttrain_stage(name: str, config_path: Path) -> float:
    """Run ``posttrain stage NAME CONFIG`` in a subprocess (a cached stage takes seconds);
    returns its wall time in seconds.

    Raises:
        RuntimeError: the stage failed (with the tail of its output).
    """
    import time

    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "WANDB_MODE": "disabled"}
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "stage", name, str(config_path)],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"posttrain stage {name} {config_path} failed:\n{(out.stdout + out.stderr)[-4000:]}")
    return time.perf_counter() - t0


def prepare_quickstart(sft_steps: int | None = None, root: Path = WORK_DIR) -> dict[str, Path]:
    """The quickstart's inputs through the ``posttrain`` stages: ``prepare``, then
    ``validate``, ``convert`` and ``sft`` when ``sft_steps`` is given. A stage whose output
    is up to date (prepare's stamp, the others' published artifact for this config and code)
    is not started at all, so a rerun takes about a second.

    Returns: ``{"data": prepared dir (rl_train.jsonl, tokenizer/, base_model/), "config": yaml}``
        plus ``"sft": the SFT policy's model directory`` when ``sft_steps`` is given.
    """
    from config.load import load_config
    from tasks.graph import stage_states
    from tasks.prepare import is_prepared

    config_path = write_quickstart_config(sft_steps, root)
    if not is_prepared(load_config(config_path)):
        print(f"  posttrain stage prepare: {run_posttrain_stage('prepare', config_path):.1f} s", flush=True)
    out = {"data": root / "quickstart", "config": config_path}
    if not sft_steps:
        return out
    for name in ("validate", "convert", "sft"):
        # Read again after each stage: a stage's fingerprint uses its inputs' content hashes.
        if stage_states(load_config(config_path))[name].ref is None:
            print(f"  posttrain stage {name}: {run_posttrain_stage(name, config_path):.1f} s", flush=True)
    out["sft"] = stage_model_dir(config_path, "sft")
    return out


def stage_model_dir(config_path: Path, stage: str) -> Path:
    """``model/`` of the published artifact of ``stage`` for the config at ``config_path``.

    Raises:
        FileNotFoundError: that stage has no artifact for this config (run it first).
    """
    from config.load import load_config
    from tasks.graph import stage_states
    from tasks.runner import store_for

    cfg = load_config(config_path)
    ref = stage_states(cfg)[stage].ref
    store = store_for(cfg)
    if ref is None:
        raise FileNotFoundError(f"no {stage} artifact for {config_path}; run `posttrain stage {stage} {config_path}`")
    return store.local_path(ref) / "model"


# ----------------------------------------------------------------------------- random models


def random_qwen2(out_dir: Path, tokenizer_dir: Path, shape: Qwen2Shape, seed: int = 0) -> Path:
    """A random-init Qwen2 HF directory of ``shape`` with the tokenizer in ``tokenizer_dir``
    and :func:`padded_vocab_size` embedding rows (kept if ``out_dir`` already holds one).

    Its ``config.json`` names the tokenizer's EOS (``<|im_end|>``), as the quickstart's
    base model does; :func:`convert_model_dir` can replace it for the engine.
    """
    from transformers import AutoTokenizer

    from conversion.random_init import init_random_hf_model

    if (out_dir / "model.safetensors").is_file():
        return out_dir
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": padded_vocab_size(len(tok)),
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    return init_random_hf_model(out_dir, config, seed=seed, tokenizer_dir=tokenizer_dir)


def unreachable_eos(hf_dir: Path) -> int:
    """The last embedding row of ``hf_dir``'s model, which no tokenizer id reaches.

    Raises:
        ValueError: the model has no row past the tokenizer's ids.
    """
    from transformers import AutoTokenizer

    vocab = int(json.loads((hf_dir / "config.json").read_text())["vocab_size"])
    tokens = len(AutoTokenizer.from_pretrained(str(hf_dir)))
    if tokens >= vocab:
        raise ValueError(f"{hf_dir}: vocab_size {vocab} has no row past the tokenizer's {tokens} ids")
    return vocab - 1


def convert_model_dir(hf_dir: Path, out_dir: Path, eos_token_ids: list[int] | None = None) -> Path:
    """The convert stage's work (``tasks/convert.py``) on ``hf_dir``: megatron-core model,
    HF -> Megatron weights, model directory with ``hf/`` config, tokenizer and generation
    config (``eos_token_ids`` replacing its EOS when given). Kept if ``out_dir`` exists.
    """
    from conversion.hf_source import check_tokenizer_fits, load_hf_source
    from conversion.registry import hf_to_megatron
    from conversion.spec import GPTSpec
    from engine.models.megatron import build_gpt_model
    from engine.models.platform import init_model_parallel
    from engine.storage.model_dir import save_model_dir

    if (out_dir / "hf" / "config.json").is_file():
        return out_dir
    source = load_hf_source(hf_dir)
    check_tokenizer_fits(source)
    init_model_parallel()
    spec = GPTSpec.from_hf_config(source.config).with_vocab_padding(128)
    model = build_gpt_model(spec)
    model.load_state_dict(hf_to_megatron(source.config, source.state, spec.padded_vocab_size), strict=True)
    overrides = {"eos_token_id": list(eos_token_ids)} if eos_token_ids else None
    return save_model_dir(out_dir, model, source.config, source.tokenizer_dir, generation_overrides=overrides)


def benchmark_model(size: str, root: Path = WORK_DIR) -> tuple[Path, Path]:
    """``(HF directory, engine model directory)`` of the random-init model ``size`` (a key of
    :data:`SHAPES`) with the quickstart tokenizer, built if missing; the engine's directory
    has the unreachable EOS (fixed-length responses, see the module docstring). Needs
    :func:`prepare_quickstart` first."""
    hf_dir = random_qwen2(root / "models" / f"qwen2-{size}", root / "quickstart" / "tokenizer", SHAPES[size])
    model_dir = convert_model_dir(hf_dir, root / "models" / f"qwen2-{size}-engine", [unreachable_eos(hf_dir)])
    return hf_dir, model_dir


def read_prompt_rows(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` rows (all if None) of a ``{"prompt": [messages], "label": str}`` JSONL file."""
    rows = []
    with path.open() as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) == limit:
                    break
    return rows


def load_avg() -> float:
    """The 1-minute load average (other processes compete for this machine's cores)."""
    return os.getloadavg()[0]


def matmul_gflops(n: int = 1024, seconds: float = 1.0, dtype: str = "float32") -> float:
    """This CPU's matmul rate now (GFLOP/s, ``2 n^3`` FLOPs per ``n x n`` product): the fastest
    product in a ``seconds`` window, with torch's default threads, in ``dtype`` (a torch dtype
    name: ``"float32"``, ``"bfloat16"``). A low figure means other processes are using the
    cores, and every throughput printed next to it is depressed too.

    fp32 is measured at size ``n``. For other dtypes the size doubles from 128 up to ``n``
    while the next size's product would take at most a quarter of the window (judged from the
    best of three products at the current size), so an emulated dtype (bf16 without hardware
    support runs at ~1 GFLOP/s) stays at a small size and the call within about ``seconds``;
    the rate of an emulated dtype hardly depends on the size.
    """
    import time

    import torch

    torch_dtype = getattr(torch, dtype)

    def product_seconds(size: int) -> float:
        a, b = torch.randn(size, size, dtype=torch_dtype), torch.randn(size, size, dtype=torch_dtype)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return best

    size = n if dtype == "float32" else 128
    while size < n and product_seconds(size) * 8 < seconds / 4:  # the next size costs 8x
        size *= 2
    a, b = torch.randn(size, size, dtype=torch_dtype), torch.randn(size, size, dtype=torch_dtype)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - t0) / 1e9)
    return best


def matmul_peaks(n: int = 2048, seconds: float = 1.0) -> dict[str, float]:
    """``{"fp32": GFLOP/s, "bf16": GFLOP/s}``: :func:`matmul_gflops` in both dtypes, measured
    now, one after the other (the peaks a throughput's MFU is divided by)."""
    return {"fp32": matmul_gflops(n, seconds, "float32"), "bf16": matmul_gflops(n, seconds, "bfloat16")}


def bf16_verdict(peaks: dict[str, float], hardware: tuple[bool, str], force: bool = False) -> tuple[bool, str]:
    """Whether the bf16 sides of a benchmark should run here, and why.

    They run when forced, or when the hardware computes bf16 natively (``hardware``, from
    :func:`config.precision.bf16_hardware`) and the measured bf16 matmul rate is above the fp32
    one. Without native bf16, torch emulates bf16 matmuls at a small fraction of the fp32 rate
    (an AVX2-only EPYC: ~1 GFLOP/s against ~300), and a bf16 side would take hours and measure
    only the emulation.

    Args:
        peaks: :func:`matmul_peaks`.
        hardware: ``(native bf16, description)``.
        force: run them anyway (``--force-bf16``).

    Returns: ``(run, reason)``, the reason naming the hardware and both rates.
    """
    rates = f"bf16 matmul {peaks['bf16']:.1f} GFLOP/s, fp32 {peaks['fp32']:.1f}"
    if force:
        return True, f"--force-bf16 ({hardware[1]}; {rates})"
    if not hardware[0]:
        return False, f"{hardware[1]} ({rates}); --force-bf16 runs them anyway"
    if peaks["bf16"] <= peaks["fp32"]:
        return False, f"{hardware[1]}, but bf16 is no faster than fp32 here ({rates}); --force-bf16 runs them anyway"
    return True, f"{hardware[1]} ({rates})"


def update_mfu(num_parameters: int, trained_tokens: float, seconds: float, peak_gflops: float) -> float:
    """Model FLOPs utilisation of a training update: ``6 N T / seconds / peak``.

    ``6 N`` FLOPs per trained token (forward ``2 N``, backward ``4 N``; Kaplan et al. 2020,
    "Scaling Laws for Neural Language Models", section 2.1; attention's sequence-length term
    left out, as in PaLM's MFU, Chowdhery et al. 2022, appendix B), ``N`` all parameters
    (embedding included), ``T`` the tokens trained on (prompt and response, no padding).

    Returns: a fraction of ``peak_gflops`` (0.35 = 35%); 0 when ``seconds`` or the peak is 0.
    """
    if seconds <= 0 or peak_gflops <= 0:
        return 0.0
    return 6.0 * num_parameters * trained_tokens / seconds / (peak_gflops * 1e9)
