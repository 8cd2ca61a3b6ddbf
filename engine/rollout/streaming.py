"""One response streamed as text while it is generated (``posttrain chat``), on either rollout engine.

vLLM: the in-process engine of :class:`engine.rollout.vllm_rollout.VLLMRollout` is stepped one
decode step at a time with a ``RequestOutputKind.DELTA`` request (each step returns only the
new token ids), and the ids are decoded incrementally. HF: ``model.generate`` of
:class:`engine.rollout.hf_rollout.HFRollout`'s model runs on a thread and hands its text to a
``transformers.TextIteratorStreamer``. Both sample as the engines' ``generate`` does (greedy at
temperature 0, stop at the model's EOS ids) and decode with special tokens skipped, so the
pieces of one response join to ``tokenizer.decode(ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine.rollout.base import SamplingSpec

_request_ids = itertools.count()


def stream_text(engine: Any, tokenizer: Any, prompt_ids: list[int], sampling: SamplingSpec) -> Iterator[str]:
    """Text pieces of one response to ``prompt_ids``, as they are generated.

    Args:
        engine: a :class:`~engine.rollout.vllm_rollout.VLLMRollout` or
            :class:`~engine.rollout.hf_rollout.HFRollout`.
        tokenizer: the model's transformers tokenizer (decodes the response).
        prompt_ids: ``[prompt_len]`` token ids (non-empty).
        sampling: ``n`` must be 1; temperature 0 is greedy; ``seed`` seeds the draw.

    Returns:
        An iterator of non-empty strings whose concatenation is the decoded response (special
        tokens, such as the final EOS, removed).

    Raises:
        ValueError: an empty prompt, ``sampling.n != 1``, or an engine of another type.
    """
    if not prompt_ids:
        raise ValueError("stream_text: the prompt has no tokens")
    if sampling.n != 1:
        raise ValueError(f"stream_text: streams one response, got n={sampling.n}")
    # transformers (via engine.rollout.hf_rollout): 1-2 s to import; only tokenizers and HF models need it
    from engine.rollout.hf_rollout import HFRollout

    if isinstance(engine, HFRollout):
        return _hf_stream(engine, tokenizer, prompt_ids, sampling)
    if hasattr(engine, "llm"):
        return _decoded(tokenizer, _vllm_token_deltas(engine, prompt_ids, sampling))
    raise ValueError(f"stream_text: unsupported engine {type(engine).__name__}")


def _vllm_token_deltas(engine, prompt_ids: list[int], sampling: SamplingSpec) -> Iterator[list[int]]:
    """New token ids of each decode step of one request on ``engine``'s in-process vLLM engine."""
    # vllm: seconds to import; only a rollout engine needs it
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = engine._sampling_params(sampling, sampling.prompt_seed(0))
    params.output_kind = RequestOutputKind.DELTA
    llm_engine = engine.llm.llm_engine
    request_id = f"stream-{next(_request_ids)}"
    llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids]), params)
    try:
        while llm_engine.has_unfinished_requests():
            for output in llm_engine.step():
                for completion in output.outputs:
                    if completion.token_ids:
                        yield list(completion.token_ids)
    finally:  # a consumer that stops early (Ctrl-C) leaves no request running
        if llm_engine.has_unfinished_requests():
            llm_engine.abort_request([request_id])


def _decoded(tokenizer, deltas: Iterable[list[int]]) -> Iterator[str]:
    """Incremental decoding: after each delta, the new suffix of the decoded text; a suffix
    ending in an incomplete UTF-8 character (U+FFFD) waits for the next token."""
    ids: list[int] = []
    shown = ""
    for delta in deltas:
        ids.extend(delta)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(shown) or text == shown:
            continue
        yield text[len(shown) :]
        shown = text
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if text != shown and text.startswith(shown):
        yield text[len(shown) :]


def _hf_stream(engine, tokenizer, prompt_ids: list[int], sampling: SamplingSpec) -> Iterator[str]:
    # transformers: 1-2 s to import; only tokenizers and HF models need it
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    ids = torch.tensor([prompt_ids], device=engine.device)
    greedy = sampling.temperature == 0.0
    sample = {} if greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else engine.eos_token_ids[0]
    generator_seed = sampling.prompt_seed(0)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            torch.manual_seed(generator_seed)
            with torch.no_grad():
                engine.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=sampling.max_new_tokens,
                    do_sample=not greedy,
                    eos_token_id=list(engine.eos_token_ids),
                    pad_token_id=pad,
                    streamer=streamer,
                    **sample,
                )
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)
            streamer.end()

    thread = threading.Thread(target=run, name="chat-generate", daemon=True)
    thread.start()
    for piece in streamer:
        if piece:
            yield piece
    thread.join()
    if failure:
        raise failure[0]
