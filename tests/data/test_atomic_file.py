"""Files the product writes get the process umask's modes, and replace their target whole or not
at all: data.atomic_file.replace_atomically, its users, and conversion.export.save_safetensors."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from conversion.export import process_umask, save_safetensors
from data.atomic_file import replace_atomically
from data.validate import write_jsonl_atomic


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_replace_atomically_writes_the_bytes_with_the_umasks_mode(tmp_path, umask):
    out = replace_atomically(tmp_path / "a" / "b.bin", lambda f: f.write(b"\x00\x01payload"))
    assert out.read_bytes() == b"\x00\x01payload"
    assert _mode(out) == 0o666 & ~umask  # 0o644 under 022, not mkstemp's 0o600
    assert sorted(p.name for p in out.parent.iterdir()) == ["b.bin"]


def test_write_jsonl_atomic_round_trips_and_gets_the_umasks_mode(tmp_path, umask):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "π", "answer": "ünïcode"}]
    out = write_jsonl_atomic(rows, tmp_path / "sft.jsonl")
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == rows
    assert _mode(out) == 0o666 & ~umask


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    target = tmp_path / "state.pt"
    target.write_bytes(b"old")

    def half(f):
        f.write(b"new, half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_atomically(target, half)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_replace_atomically_refuses_an_appending_mode(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb', got 'a'"):
        replace_atomically(tmp_path / "x", lambda f: None, mode="a")


def test_process_umask_reads_the_mask_without_changing_it(umask):
    assert process_umask() == umask
    assert process_umask() == umask


def test_save_safetensors_round_trips_and_gets_the_umasks_mode(tmp_path, umask):
    tensors = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.tensor([1.5])}
    out = save_safetensors(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_file(str(out))
    assert loaded.keys() == tensors.keys()
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype
    assert _mode(out) == 0o666 & ~umask  # save_file alone gives 0o600
