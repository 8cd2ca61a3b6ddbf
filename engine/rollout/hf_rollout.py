"""Rollout with HF transformers, for policies vLLM cannot serve on CPU (e.g. head_dim < 32).

Token-in/token-out: prompts arrive as token ids, responses leave as token ids with the
log-probability of every sampled token, exactly as :class:`engine.rollout.base.RolloutEngine`
specifies. The decoding loop is our own (not ``model.generate``) so the sampling
distribution, the seed and the reported log-probabilities are explicit; greedy decoding is
tested token for token against ``model.generate(do_sample=False)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig

from engine.rollout.base import RolloutOutput, SamplingSpec
from engine.rollout.hf_routing import ExpertRecorder
from engine.rollout.hf_weight_names import checkpoint_views

if TYPE_CHECKING:
    from engine.rollout.hf_weight_names import CheckpointView


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose mass reaches ``top_p``.

    A token is kept when the probability mass of the tokens strictly more likely than it
    (in sorted order) is below ``top_p``, so the most likely token is always kept.
    Source: Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", sec. 3.1.

    Args:
        logits: ``[B, V]`` (already divided by the temperature).
    Returns:
        ``[B, V]``, removed tokens set to ``-inf``.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class HFRollout:
    """A :class:`~engine.rollout.base.RolloutEngine` running an HF causal LM on CPU (or a device).

    Sampling: with ``temperature == 0`` the argmax token (greedy); otherwise a draw from
    ``softmax(logits / temperature)`` restricted to the top-p nucleus and renormalized.
    Draws come from one ``torch.Generator`` seeded with ``SamplingSpec.seed`` at each
    :meth:`generate` call (``seed + prompt_index[0] * n`` for a share of a larger batch), so a
    call is reproducible and a new seed gives new samples; a prompt's samples depend on the
    other prompts of the call (they draw from the same stream).

    Reported log-probabilities (``RolloutOutput.logprobs``, nats) are those of the
    distribution each token was drawn from: ``log_softmax(logits / temperature)[token]``,
    renormalized over the top-p nucleus when ``top_p < 1``; with ``temperature == 0`` they
    are ``log_softmax(logits)[token]``. This is what vLLM reports with
    ``logprobs_mode="processed_logprobs"``, so both backends agree. At temperature 1 and
    top_p 1 it is the policy's own distribution, which is what the RL loss compares.

    Batching: each prompt is repeated ``n`` times; sequences are left-padded and decoded
    in chunks of at most ``max_batch_size`` with a KV cache. Position ids count only real
    tokens (padding does not shift positions). A sequence stops after sampling any EOS id
    (``finish_reason="stop"``, EOS kept as its last token) or after ``max_new_tokens``
    (``"length"``).

    Routed experts (``SamplingSpec.return_routed_experts``, MoE models): forward hooks on the
    gates keep the top-k indices the model itself used (:class:`engine.rollout.hf_routing.ExpertRecorder`):
    the prefill's for the prompt tokens and one decode step's per response token. The last
    sampled token is fed to the model once more, so every token of prompt + response has its routing.

    Args:
        model_dir: HF model directory with ``config.json`` and SafeTensors weights
            (``model.safetensors`` or a sharded index); a tokenizer may sit beside them but
            is not needed (token-in/token-out).
        dtype: compute dtype of the weights, activations and KV cache (default float32): a
            torch dtype or its name (``"bfloat16"``, the stage's precision as
            ``config.precision.DTYPE_NAMES`` spells it). Weights stored in another dtype are
            cast on load (float32 -> bfloat16 rounds to nearest even); the logits are upcast
            to float32 before sampling and log-probabilities. Kept as :attr:`dtype`.
        device: torch device (default CPU).
        max_batch_size: sequences (prompts x n) decoded together.
        eos_token_ids: overrides the EOS ids read from ``generation_config.json`` /
            ``config.json``.

    Raises:
        FileNotFoundError: ``model_dir`` lacks ``config.json`` or SafeTensors weights.
        ValueError: no EOS id is known (give ``eos_token_ids``); ``dtype`` is not a
            floating-point torch dtype.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
        max_batch_size: int = 64,
        eos_token_ids: Iterable[int] | None = None,
    ) -> None:
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"HFRollout: {path / 'config.json'} not found (need an HF model directory)")
        if not ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()):
            raise FileNotFoundError(f"HFRollout: no model.safetensors (or model.safetensors.index.json) in {path}")
        if max_batch_size <= 0:
            raise ValueError(f"HFRollout: max_batch_size must be positive, got {max_batch_size}")
        resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise ValueError(f"HFRollout: dtype must be a floating-point torch dtype or its name, got {dtype!r}")
        self.dtype: torch.dtype = resolved
        # use_safetensors=True: never unpickle weights.
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=resolved, use_safetensors=True).to(device)  # type: ignore[arg-type]  # transformers' wrapper of Module.to loses its signature
        self.model.eval()
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self._checkpoint_views: dict[str, CheckpointView] | None = (
            None  # checkpoint names held in another layout (update_weights)
        )
        self._experts: ExpertRecorder | None = None  # built on the first return_routed_experts call

        try:
            gen_cfg = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: fall back to config.json
            gen_cfg = None
        cfg = self.model.config
        if eos_token_ids is not None:
            eos = [int(t) for t in eos_token_ids]
        else:
            eos = _as_id_list(getattr(gen_cfg, "eos_token_id", None)) or _as_id_list(cfg.eos_token_id)
        if not eos:
            raise ValueError(
                f"HFRollout: no eos_token_id in {path}/generation_config.json or config.json; pass eos_token_ids"
            )
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        pad = getattr(gen_cfg, "pad_token_id", None)
        if pad is None:
            pad = getattr(cfg, "pad_token_id", None)
        # The pad id only fills masked positions and finished rows; any valid id works.
        self.pad_token_id: int = int(pad) if pad is not None else self.eos_token_ids[0]
        self.vocab_size: int = int(self.model.get_input_embeddings().weight.shape[0])

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec) -> list[list[RolloutOutput]]:
        """Sample ``sampling.n`` responses for each prompt.

        Args:
            prompt_token_ids: ``P`` prompts, each a non-empty list of token ids in ``[0, V)``.
            sampling: n, temperature (0 = greedy), top_p, max_new_tokens, seed.

        Returns:
            ``P`` lists of ``n`` :class:`RolloutOutput` each, in prompt order.

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, or a bad
                sampling field (the message names the prompt index or field); with
                ``return_routed_experts``, a model without MoE gates.
        """
        self._check(prompt_token_ids, sampling)
        if sampling.return_routed_experts and self._experts is None:
            self._experts = ExpertRecorder(self.model)
        generator = torch.Generator(device=self.device).manual_seed(int(sampling.prompt_seed(0)))
        sequences = [list(p) for p in prompt_token_ids for _ in range(sampling.n)]
        flat: list[RolloutOutput] = []
        for start in range(0, len(sequences), self.max_batch_size):
            flat.extend(self._generate_chunk(sequences[start : start + self.max_batch_size], sampling, generator))
        return [flat[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompt_token_ids))]

    def _check(self, prompts: list[list[int]], sampling: SamplingSpec) -> None:
        if sampling.n < 1:
            raise ValueError(f"SamplingSpec.n must be >= 1, got {sampling.n}")
        if sampling.temperature < 0:
            raise ValueError(f"SamplingSpec.temperature must be >= 0, got {sampling.temperature}")
        if not 0 < sampling.top_p <= 1:
            raise ValueError(f"SamplingSpec.top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.max_new_tokens < 1:
            raise ValueError(f"SamplingSpec.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"HFRollout.generate: prompt {i} is empty")
            bad = [t for t in p if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(
                    f"HFRollout.generate: prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}"
                )

    def _pick(self, logits: torch.Tensor, sampling: SamplingSpec, generator: torch.Generator):
        """Choose the next tokens. ``logits``: ``[B, V]`` float32. Returns ids ``[B]`` and logprobs ``[B]``."""
        if sampling.temperature == 0:
            tokens = torch.argmax(logits, dim=-1)
            logp = torch.log_softmax(logits, dim=-1)
        else:
            scaled = logits / sampling.temperature
            if sampling.top_p < 1:
                scaled = _top_p_filter(scaled, sampling.top_p)
            logp = torch.log_softmax(scaled, dim=-1)
            tokens = torch.multinomial(logp.exp(), num_samples=1, generator=generator).squeeze(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    @torch.inference_mode()
    def _generate_chunk(
        self, prompts: list[list[int]], sampling: SamplingSpec, generator: torch.Generator
    ) -> list[RolloutOutput]:
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: the last prompt token is always at the end
            input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[row, width - len(p) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

        if sampling.return_routed_experts:
            assert self._experts is not None  # built by generate
            with self._experts.recording() as recorder:
                return self._decode(prompts, input_ids, attention_mask, position_ids, sampling, generator, recorder)
        return self._decode(prompts, input_ids, attention_mask, position_ids, sampling, generator, None)

    def _decode(
        self,
        prompts: list[list[int]],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        sampling: SamplingSpec,
        generator: torch.Generator,
        recorder: ExpertRecorder | None,
    ) -> list[RolloutOutput]:
        batch, width = input_ids.shape
        eos = torch.tensor(self.eos_token_ids, device=self.device)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        next_pos = position_ids[:, -1:] + 1
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.full((batch,), sampling.max_new_tokens, dtype=torch.long)
        chosen, chosen_logp = [], []
        for step in range(sampling.max_new_tokens):
            tokens, logp = self._pick(out.logits[:, -1, :].float(), sampling, generator)
            tokens = torch.where(finished, torch.full_like(tokens, self.pad_token_id), tokens)
            chosen.append(tokens)
            chosen_logp.append(logp)
            stopped = torch.isin(tokens, eos) & ~finished
            lengths[stopped.cpu()] = step + 1
            finished |= stopped
            done = bool(finished.all()) or step == sampling.max_new_tokens - 1
            if done and recorder is None:
                break
            attention_mask = torch.cat(
                [attention_mask, torch.ones((batch, 1), dtype=torch.long, device=self.device)], dim=-1
            )
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            next_pos = next_pos + 1
            if done:  # routed experts: the last sampled tokens' forward gave their routing
                break

        token_matrix = torch.stack(chosen, dim=1).cpu()
        logp_matrix = torch.stack(chosen_logp, dim=1).cpu()
        finished = finished.cpu()
        routed = None
        if recorder is not None:  # [batch, width + steps, layers, k]: the prefill, then one decode step each
            routed = torch.cat([recorder.take(batch) for _ in range(token_matrix.size(1) + 1)], dim=1)
        results = []
        for row in range(batch):
            n = int(lengths[row])
            results.append(
                RolloutOutput(
                    token_ids=tuple(int(t) for t in token_matrix[row, :n]),
                    logprobs=tuple(float(x) for x in logp_matrix[row, :n]),
                    finish_reason="stop" if bool(finished[row]) else "length",
                    # left-padded prompt (its last len(prompt) columns), then the first n response tokens
                    routed_experts=None
                    if routed is None
                    else routed[row, width - len(prompts[row]) : width + n].clone(),
                )
            )
        return results

    # ------------------------------------------------------------------ weight sync

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new policy weights into the model in place.

        Args:
            named_tensors: ``(hf_name, tensor)`` pairs, names as in the model's
                ``state_dict()`` (e.g. ``model.layers.0.self_attn.q_proj.weight``) or as in its
                checkpoint where transformers holds them in another layout (a mixture-of-experts
                layer's ``mlp.experts.{j}.gate_proj.weight``, fused in memory into
                ``mlp.experts.gate_up_proj``: :func:`engine.rollout.hf_weight_names.checkpoint_views`),
                each tensor full and of the checkpoint's shape; any dtype/device (cast on copy). A
                subset of the parameters may be given; the others keep their values.

        Raises:
            KeyError: a name the model does not have (named in the message).
            ValueError: a shape that differs from the parameter's (name and both shapes).
            Every pair is checked before any is copied, so a failed update leaves the old
            weights untouched.
        """
        state = self.model.state_dict(keep_vars=True)
        pending = []
        for name, tensor in named_tensors:
            if name in state:
                shape = tuple(state[name].shape)
            else:
                if self._checkpoint_views is None:  # built once, on the first name it is needed for
                    self._checkpoint_views = checkpoint_views(self.model)
                if name not in self._checkpoint_views:
                    raise KeyError(f"HFRollout.update_weights: unknown parameter name {name!r}")
                shape = self._checkpoint_views[name].shape
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"HFRollout.update_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {shape}"
                )
            pending.append((name, tensor))
        with torch.no_grad():
            for name, tensor in pending:
                if name in state:
                    state[name].copy_(tensor)
                else:
                    assert self._checkpoint_views is not None  # built above for every name not in state
                    self._checkpoint_views[name].write(state, tensor)
