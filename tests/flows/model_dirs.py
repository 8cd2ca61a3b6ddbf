"""Model directories for the tests of what validate reads: an HF directory holds config.json
and weights, and the checks refuse one without weights (flows.content_checks.missing_weights)."""

from __future__ import annotations

from pathlib import Path


def write_stand_in_weights(model_dir: Path, hidden_size: int) -> Path:
    """``model.safetensors`` holding ``model.norm.weight`` (ones, ``[hidden_size]``): one
    tensor of the model, standing in for all of them (validate reads no tensor), so a test
    of a 0.5B model's config does not write 2 GB."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(hidden_size)}, str(model_dir / "model.safetensors"))
    return model_dir / "model.safetensors"
