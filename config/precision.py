"""Which compute precision a stage runs in: ``bf16`` or ``fp32``, and ``auto`` resolved by the hardware.

``auto`` is bf16 on a CUDA device of compute capability >= 8.0 (Ampere and later: bf16 tensor
cores) and fp32 everywhere else:

- CUDA < 8.0 has no bf16 tensor cores (fp16 would need loss scaling, which is not done here);
- a CPU, even one that computes bf16 natively (``avx512_bf16`` or ``amx_bf16``: Intel Cooper
  Lake, Sapphire Rapids and later, AMD Zen 4 and later). Measured on the quickstart (Zen 4,
  docs/platforms.md "Does bf16 train worse?"): paired over the same seed, the bf16 pipeline's
  SFT and RL accuracies were below fp32's at both seeds run (SFT -0.090 and -0.067, RL -0.062
  and -0.169), while the SFT loss curves over 4 seeds showed no gap beyond the run-to-run
  spread; the models a CPU trains are small enough that bf16 buys little time. bf16 on CPU
  stays available by setting it. Without those instruction sets torch emulates bf16 matmuls
  (measured on an AVX2-only EPYC: 2048^2 bf16 matmul 0.3 GFLOP/s against 175 GFLOP/s in fp32).

The config resolves ``auto`` once, when it is loaded (``config.schema.PipelineConfig``), so the
concrete precision is what every stage's fingerprint and manifest record. This module does
not import torch unless an NVIDIA driver is present (a cached pipeline run must not pay for
the import); the hardware is read from ``/proc/cpuinfo``.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from typing import Literal

Precision = Literal["bf16", "fp32"]  # resolved; config.run.Precision adds "auto"
DTYPE_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp32": "float32"}
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where it does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags") or line.startswith("Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cuda_capability() -> tuple[int, int] | None:
    """Compute capability of CUDA device 0, or None without a CUDA device. Imports torch only
    when an NVIDIA driver is present (or torch is already imported)."""
    if "torch" not in sys.modules and not (os.path.exists("/proc/driver/nvidia") or shutil.which("nvidia-smi")):
        return None
    import torch  # heavy and optional here: only when a GPU may be present

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(0)


@functools.cache
def bf16_hardware() -> tuple[bool, str]:
    """Whether this machine computes bf16 natively, and why: ``(True, "CUDA compute capability
    8.0")``, ``(True, "CPU has amx_bf16, avx512_bf16")`` or ``(False, "CPU lacks avx512_bf16
    and amx_bf16")``. A CUDA device decides when there is one (training runs on it)."""
    capability = _cuda_capability()
    if capability is not None:
        text = f"CUDA compute capability {capability[0]}.{capability[1]}"
        return capability >= (8, 0), text + ("" if capability >= (8, 0) else " (< 8.0)")
    have = sorted(set(_CPU_BF16_FLAGS) & _cpu_flags())
    if have:
        return True, f"CPU has {', '.join(have)}"
    return False, "CPU lacks avx512_bf16 and amx_bf16"


def auto_precision() -> tuple[Precision, str]:
    """What ``auto`` resolves to on this machine and why (module docstring): ``("bf16", "CUDA
    compute capability 8.0")``, or fp32 with the reason, e.g. ``("fp32", "CPU has avx512_bf16;
    auto is fp32 on CPU")``."""
    native, why = bf16_hardware()
    if why.startswith("CUDA"):
        return ("bf16" if native else "fp32"), why
    return "fp32", why + "; auto is fp32 on CPU"


def resolve_precision(setting: str | None) -> Precision:
    """The concrete precision for a config value: ``"bf16"``/``"fp32"`` as given; ``"auto"``
    or None: :func:`auto_precision`.

    Raises:
        ValueError: any other value (names the accepted ones).
    """
    if setting in ("bf16", "fp32"):
        return setting  # type: ignore[return-value]
    if setting in (None, "auto"):
        return auto_precision()[0]
    raise ValueError(f"precision must be 'bf16', 'fp32' or 'auto', got {setting!r}")


def describe_precision(precision: str, run_setting: str = "auto") -> str:
    """One line for a stage's log: its resolved ``precision``, the ``run.precision`` setting it
    came from and why ``auto`` resolves as it does here, e.g. ``"precision fp32 (run.precision
    auto; CPU lacks avx512_bf16 and amx_bf16; auto is fp32 on CPU)"``."""
    return f"precision {precision} (run.precision {run_setting}; {auto_precision()[1]})"
