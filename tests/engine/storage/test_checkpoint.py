"""torch_dist checkpoints: Megatron-LM layout, atomic saves, bit-identical HF round trip."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from conversion import hf_to_megatron, megatron_to_hf
from conversion.spec import GPTSpec
from engine.models.megatron import build_gpt_model, load_mcore_state, mcore_state
from engine.storage.torch_dist import (
    latest_checkpoint,
    load_checkpoint_hf_config,
    load_model_checkpoint,
    save_model_checkpoint,
)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)


def random_hf(arch: str):
    torch.manual_seed(0)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=400,
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=300,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=4,
                tie_word_embeddings=False,
            )
        )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):  # HF initialises these to constants
                p.normal_()
    # As read from a config.json (JSON turns id2label's int keys into strings).
    cfg = json.loads(json.dumps({**model.config.to_dict(), "architectures": [type(model).__name__]}))
    return cfg, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_hf_megatron_torch_dist_hf_round_trip_is_bit_identical(tmp_path, arch):
    cfg, hf = random_hf(arch)
    spec = GPTSpec.from_hf_config(cfg)
    model = build_gpt_model(spec, seed=1)
    load_mcore_state(model, hf_to_megatron(cfg, hf))
    path = save_model_checkpoint(model, tmp_path / "ckpt", iteration=None, hf_config=cfg)
    assert path == tmp_path / "ckpt" / "release"

    # Different random weights, overwritten by the load; the core attention holds no weights,
    # so a checkpoint saved with one backend loads into the other.
    fresh = build_gpt_model(spec, seed=2, core_attention="sdpa")
    assert load_model_checkpoint(fresh, tmp_path / "ckpt") is None
    restored_cfg = load_checkpoint_hf_config(tmp_path / "ckpt")
    assert restored_cfg == cfg
    back = dict(megatron_to_hf(restored_cfg, mcore_state(fresh)))
    expected = {k: v for k, v in hf.items() if not (spec.tie_word_embeddings and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(back[name], t), name


def test_a_save_starts_no_process_and_round_trips(tmp_path, monkeypatch):
    """megatron forks a writer per bucket; a forked child of a threaded process can die (seen:
    SIGABRT) and leave the save waiting forever, so saves write in this process. Its results
    queue would be a ``spawn`` manager's, a server process that outlives a SIGKILLed parent, so
    it is an in-process queue. With os.fork and every multiprocessing start refused, the first
    save in the process and a second one (several buckets' worth of tensors) write checkpoints
    that load back bit for bit."""
    import multiprocessing.process
    import os

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def refuse(*args, **kwargs):
        raise AssertionError("a process was started during a torch_dist save")

    cfg, hf = random_hf("qwen2")
    spec = GPTSpec.from_hf_config(cfg)
    model = build_gpt_model(spec, seed=1)
    load_mcore_state(model, hf_to_megatron(cfg, hf))
    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a fresh process
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    save_model_checkpoint(model, tmp_path / "first", iteration=1)
    save_model_checkpoint(model, tmp_path / "ckpt", iteration=2)
    monkeypatch.undo()
    assert len(list((tmp_path / "ckpt" / "iter_0000002").glob("*.distcp"))) >= 2  # megatron's 2 buckets per rank
    fresh = build_gpt_model(spec, seed=2)
    assert load_model_checkpoint(fresh, tmp_path / "ckpt") == 2
    want, got = mcore_state(model), mcore_state(fresh)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_megatron_lm_layout_and_latest_iteration(tmp_path):
    cfg, hf = random_hf("qwen2")
    spec = GPTSpec.from_hf_config(cfg)
    model = build_gpt_model(spec, seed=1)
    root = tmp_path / "ckpt"
    save_model_checkpoint(model, root, iteration=5)
    first = mcore_state(model)
    first = {k: v.clone() for k, v in first.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_model_checkpoint(model, root, iteration=123)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "123"
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000005",
        "iter_0000123",
        "latest_checkpointed_iteration.txt",
    ]
    assert {"metadata.json", "common.pt"} <= {p.name for p in (root / "iter_0000123").iterdir()}
    assert latest_checkpoint(root) == (root / "iter_0000123", 123)

    fresh = build_gpt_model(spec, seed=3)
    assert load_model_checkpoint(fresh, root) == 123
    loaded = mcore_state(fresh)
    assert all(torch.equal(loaded[k], first[k] + 1.0) for k in first)

    # Overwriting an iteration replaces it atomically; the tracker follows the newest save.
    save_model_checkpoint(build_gpt_model(spec, seed=4), root, iteration=5)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000005",
        "iter_0000123",
        "latest_checkpointed_iteration.txt",
    ]
    with pytest.raises(FileNotFoundError, match="no HF config"):
        load_checkpoint_hf_config(root)


def test_bad_checkpoints_raise_clear_errors(tmp_path):
    cfg, _ = random_hf("qwen2")
    spec = GPTSpec.from_hf_config(cfg)
    with pytest.raises(FileNotFoundError, match="latest_checkpointed_iteration.txt: no checkpoint tracker"):
        load_model_checkpoint(build_gpt_model(spec), tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("banana")
    with pytest.raises(ValueError, match="'banana'"):
        latest_checkpoint(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(FileNotFoundError, match="iter_0000007"):
        latest_checkpoint(tmp_path)

    save_model_checkpoint(build_gpt_model(spec), tmp_path / "small", iteration=1)
    wider = build_gpt_model(spec.model_copy(update={"ffn_hidden_size": 384}))
    with pytest.raises(ValueError, match=r"does not fit the model: .*shape mismatch.*mlp\.linear_fc1\.weight"):
        load_model_checkpoint(wider, tmp_path / "small")


def test_checkpoint_io_after_the_process_group_was_destroyed(tmp_path):
    """vLLM's in-process engine tears down torch.distributed when it shuts down; a model
    built before must still save and load (torch_dist asks the default group for its rank),
    and megatron's parallel state is rebuilt on a live group rather than left stale."""
    from megatron.core import parallel_state

    from engine.models.platform import init_model_parallel

    cfg, hf = random_hf("qwen2")
    spec = GPTSpec.from_hf_config(cfg)
    model = build_gpt_model(spec, seed=1)
    load_mcore_state(model, hf_to_megatron(cfg, hf))
    torch.distributed.destroy_process_group()
    assert not torch.distributed.is_initialized()
    save_model_checkpoint(model, tmp_path / "ckpt", iteration=None, hf_config=cfg)
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
    init_model_parallel()
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    fresh = build_gpt_model(spec, seed=2)
    load_model_checkpoint(fresh, tmp_path / "ckpt")
    saved = mcore_state(model)
    assert all(torch.equal(t, saved[k]) for k, t in mcore_state(fresh).items())


def test_a_model_built_after_the_process_group_was_destroyed_runs():
    """The model builder rebuilds megatron's state on a live group when the default group
    died under it (as after a vLLM engine's shutdown), so the new model's forward works."""
    from engine.models.megatron import gpt_logits

    cfg, hf = random_hf("llama")
    spec = GPTSpec.from_hf_config(cfg)
    build_gpt_model(spec, seed=1)
    torch.distributed.destroy_process_group()
    model = build_gpt_model(spec, seed=1).eval()
    load_mcore_state(model, hf_to_megatron(cfg, hf))
    ids = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert gpt_logits(model, ids).shape == (1, 7, 300)
    assert torch.distributed.is_initialized()


_SAVE_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
import torch
from engine.storage.torch_dist import save_model_checkpoint
from engine.models.megatron import GPTSpec, build_gpt_model, load_mcore_state
from engine.models.platform import init_model_parallel
from conversion import hf_to_megatron
from tests.engine.storage.test_checkpoint import random_hf

if __name__ == "__main__":  # megatron's save spawns a helper process that imports this file
    init_model_parallel()
    cfg, state = random_hf("qwen2")
    spec = GPTSpec.from_hf_config(cfg)
    model = build_gpt_model(spec, seed=1)
    load_mcore_state(model, hf_to_megatron(cfg, state))
    save_model_checkpoint(model, sys.argv[1], iteration=3, hf_config=cfg)
"""


def test_two_saves_of_the_same_weights_are_byte_identical(tmp_path):
    """A rebuilt model directory must have the content hash of the first build (early cut-off):
    torch.distributed checkpoint's .metadata held the temporary directory it was written to
    and a random save id, so every save differed."""
    import hashlib
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    script = tmp_path / "save.py"
    script.write_text(_SAVE_SCRIPT.format(repo=str(repo)))
    digests = []
    for name in ("a", "b"):  # separate processes: other temp names, other uuids, other hash seeds
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path / name)], capture_output=True, text=True, cwd=repo
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        root = tmp_path / name
        digests.append(
            {
                p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*"))
                if p.is_file()
            }
        )
    assert digests[0] == digests[1]
    assert ".metadata" in {Path(k).name for k in digests[0]}
    with open(tmp_path / "a" / "iter_0000003" / ".metadata", "rb") as f:
        assert pickle.load(f).storage_meta is None
    model = build_gpt_model(GPTSpec.from_hf_config(random_hf("qwen2")[0]), seed=2)
    assert load_model_checkpoint(model, tmp_path / "b") == 3  # still loads
