"""A train state's integrity (engine.storage.train_state): flipped bits and truncated shards in
a real saved state are refused on resume by name (file, expected and actual sha256 or size,
the directory to delete), never resumed; a full disk during a save is one line naming the
directory, the space needed and free, and the fix, and leaves the previous state loadable.

The full disk is a real one: a tmpfs a little larger than one state (``small_filesystem`` in
tests/conftest.py), so the second save runs out of space inside torch.distributed.checkpoint's
writer and the single-file save inside torch's zip writer ("unexpected pos")."""

from __future__ import annotations

import hashlib
import re

import pytest
import torch

from config.training import OptimConfig
from conversion.spec import GPTSpec
from data.checksums import CHECKSUMS
from data.disk_full import DiskFull
from engine.storage.train_state import (
    STATE_FILE,
    CorruptCheckpoint,
    DataPosition,
    check_run_identity,
    load_train_state,
    save_train_state,
)
from engine.training.optimizer_step import build_model_optimizer, train_step

VOCAB = 64
SPEC = GPTSpec(
    architecture="qwen2",
    vocab_size=VOCAB,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    ffn_hidden_size=64,
    max_position_embeddings=64,
    rope_theta=1e4,
    norm_epsilon=1e-6,
    add_qkv_bias=True,
    tie_word_embeddings=True,
    head_dim=16,
)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, weight_decay=0.1, grad_clip=1.0)
POS = DataPosition(0, 4, 7)


def logit_loss(model, ids):
    logits = model(ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
    return logits.float().pow(2).mean(), ids.numel(), {}


def trained(seed: int = 0, steps: int = 1):
    """A tiny GPTModel after ``steps`` AdamW steps (fp32)."""
    from engine.models.megatron import build_gpt_model

    model = build_gpt_model(SPEC, seed=seed)
    optimizer, scheduler = build_model_optimizer(model, OPTIM, 6, "fp32")
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        train_step(
            model, optimizer, scheduler, [torch.randint(0, VOCAB, (2, 8), generator=gen)], logit_loss, OPTIM.grad_clip
        )
    return model, optimizer, scheduler


def save(directory, step: int, model, optimizer, scheduler):
    return save_train_state(
        directory,
        step=step,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data_position=POS,
        extra={"config": "c"},
    )


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def largest_shard(tmp_path):
    checkpoint = load_train_state(tmp_path).checkpoint
    return max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)


def test_flipped_bits_in_a_shard_refuse_the_resume_naming_the_file_and_both_sha256s(tmp_path):
    """Before checksums this state resumed silently with other weights (dcp reads raw bytes)."""
    model, opt, sched = trained()
    save(tmp_path, 1, model, opt, sched)
    shard = largest_shard(tmp_path)
    expected = sha256(shard)
    data = bytearray(shard.read_bytes())
    for i in (len(data) // 2, len(data) // 2 + 97, len(data) // 3):
        data[i] ^= 0x10  # a few flipped bits inside the tensors' bytes
    shard.write_bytes(bytes(data))
    actual = sha256(shard)

    assert check_run_identity(tmp_path, {"config": "c"}) == 1  # the index itself is intact
    with pytest.raises(CorruptCheckpoint) as err:
        load_train_state(tmp_path)
    message = str(err.value)
    assert message == (
        f"refusing to resume from a corrupt train state: {shard}: sha256 {actual}, {CHECKSUMS} records "
        f"sha256 {expected}; no earlier state is kept: delete {tmp_path} and rerun the same command to "
        "start this stage over"
    )
    assert "\n" not in message


def test_a_truncated_shard_is_named_with_both_sizes_not_as_a_model_mismatch(tmp_path):
    model, opt, sched = trained()
    save(tmp_path, 1, model, opt, sched)
    shard = largest_shard(tmp_path)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    with pytest.raises(
        CorruptCheckpoint,
        match=rf"^refusing to resume from a corrupt train state: {re.escape(str(shard))}: "
        rf"size {size // 2} bytes, {CHECKSUMS} records size {size} bytes; "
        rf"no earlier state is kept: delete {re.escape(str(tmp_path))}",
    ):
        load_train_state(tmp_path)
    assert "does not fit the model" not in str(pytest.raises(CorruptCheckpoint, load_train_state, tmp_path).value)


def test_a_changed_index_or_manifest_is_refused(tmp_path):
    """The index is listed beside it, and the shard directory's manifest is pinned by the index:
    editing either (here: the manifest rewritten to match a damaged shard) is refused."""
    model, opt, sched = trained()
    save(tmp_path, 1, model, opt, sched)
    checkpoint = load_train_state(tmp_path).checkpoint
    manifest = checkpoint / CHECKSUMS
    pinned = sha256(manifest)
    manifest.write_text(manifest.read_text().replace('"sha256": "', '"sha256": "0', 1))
    with pytest.raises(
        CorruptCheckpoint,
        match=rf"{re.escape(str(manifest))}: sha256 {sha256(manifest)}, "
        rf"{re.escape(str(tmp_path / STATE_FILE))} records sha256 {pinned}",
    ):
        load_train_state(tmp_path)

    index = tmp_path / STATE_FILE
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 1
    index.write_bytes(bytes(data))
    with pytest.raises(
        CorruptCheckpoint, match=rf"{re.escape(str(index))}: sha256 [0-9a-f]{{64}}, {CHECKSUMS} records"
    ):
        check_run_identity(tmp_path, {"config": "c"})  # the first read of a resume


def test_a_flipped_bit_in_a_single_file_state_is_refused(tmp_path):
    """The single-file format (models without megatron modules: the DeepSpeed backend's)."""
    plain = torch.nn.Linear(64, 32)
    optimizer, scheduler = build_model_optimizer(plain, OPTIM, 6, "fp32")
    save(tmp_path, 1, plain, optimizer, scheduler)
    assert load_train_state(tmp_path).step == 1
    state = tmp_path / STATE_FILE
    expected = sha256(state)
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x04
    state.write_bytes(bytes(data))
    with pytest.raises(
        CorruptCheckpoint,
        match=rf"{re.escape(str(state))}: sha256 {sha256(state)}, {CHECKSUMS} records "
        rf"sha256 {expected}",
    ):
        load_train_state(tmp_path)


def _free_line(message: str) -> tuple[str, str]:
    found = re.search(r"needs about ([\d.]+ \w+), and ([\d.]+ \w+) are free there", message)
    assert found, message
    return found.group(1), found.group(2)


def test_a_full_disk_during_a_sharded_save_is_one_line_and_keeps_the_previous_state(small_filesystem):
    disk = small_filesystem("600k")  # one state (about 420 KiB) fits, a second beside it does not
    model, opt, sched = trained()
    save(disk, 1, model, opt, sched)
    before = sorted(p.name for p in disk.iterdir())
    weights = {k: v.clone() for k, v in load_train_state(disk).model.items()}

    with pytest.raises(DiskFull) as err:
        save(disk, 2, model, opt, sched)
    message = str(err.value)
    assert message.startswith(f"disk full: the train state of step 2 at {disk} needs about ")
    assert message.endswith(
        "; free space there or set run.checkpoint_root to a directory on a file system with room; "
        "the last checkpoint is kept, so a rerun resumes from it"
    )
    needed, free = _free_line(message)
    on_disk = sum(p.stat().st_size for p in disk.rglob("*") if p.is_file())  # one state, as the first save wrote it
    assert needed.endswith("KiB") and 0.5 * on_disk < float(needed.split()[0]) * 1024 <= on_disk, (needed, on_disk)
    assert free.endswith("KiB") and float(free.split()[0]) * 1024 < 600 * 1024 - on_disk + 4096, (free, on_disk)
    assert "\n" not in message and err.value.errno == 28
    assert isinstance(err.value, Exception)  # not the BaseException torch raises: Prefect marks the stage Failed

    assert sorted(p.name for p in disk.iterdir()) == before  # no partial directory left
    state = load_train_state(disk)  # the previous state, verified
    assert state.step == 1 and all(torch.equal(state.model[k], weights[k]) for k in weights)


def test_a_full_disk_during_a_single_file_save_is_one_line_not_unexpected_pos(small_filesystem):
    disk = small_filesystem("64k")
    plain = torch.nn.Linear(64, 32)  # about 8 KiB of weights, 25 KiB with the AdamW moments
    optimizer, scheduler = build_model_optimizer(plain, OPTIM, 6, "fp32")
    save(disk, 1, plain, optimizer, scheduler)
    big = torch.nn.Linear(256, 128)  # about 400 KiB with its moments
    big_opt, big_sched = build_model_optimizer(big, OPTIM, 6, "fp32")
    big(torch.ones(1, 256)).sum().backward()
    big_opt.step()
    with pytest.raises(DiskFull) as err:
        save(disk, 2, big, big_opt, big_sched)
    assert "unexpected pos" not in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"disk full: the train state of step 2 at {disk} needs about "), str(err.value)
    needed, free = _free_line(str(err.value))
    assert needed == f"{(32896 * 3 + 2) * 4 / 1024:.1f} KiB"  # weights and two moments, fp32, and the step counts
    assert float(free.split()[0]) < 64
    assert load_train_state(disk).step == 1
