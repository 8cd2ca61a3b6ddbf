"""What tests/engine/distributed/test_sequence_parallel.py runs on the ranks of a tensor-parallel
group (a module of its own: the Ray ranks import it by name)."""

from __future__ import annotations


def forward_outputs(model_dir: str) -> dict:
    """On every rank (a collective under tensor parallelism): the model directory's model as the
    stages load it, run without gradients on 3 rows of odd width 7 (right-padded by lengths 7, 4,
    2) and on the same rows packed (13 tokens, odd): ``{"logits", "logits_packed", "hidden",
    "hidden_packed"}`` plus the model's ``sequence_parallel`` flag and the names of the parameters
    megatron marks ``sequence_parallel``."""
    import torch

    from engine.batching.packing import pack_sequences
    from engine.models.megatron import gpt_hidden_states, gpt_hidden_states_packed, gpt_logits, gpt_logits_packed
    from engine.storage.model_dir import load_model_dir

    model = load_model_dir(model_dir).model.eval()
    ids = torch.randint(3, 300, (3, 7), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([7, 4, 2])
    ids = ids * (torch.arange(7)[None, :] < lengths[:, None])  # right padding (token 0)
    packed = pack_sequences(ids, lengths)
    with torch.no_grad():
        return {
            "logits": gpt_logits(model, ids),
            "logits_packed": gpt_logits_packed(model, packed),
            "hidden": gpt_hidden_states(model, ids).float(),
            "hidden_packed": gpt_hidden_states_packed(model, packed).float(),
            "sequence_parallel": bool(model.config.sequence_parallel),
            "marked": sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)),
        }
