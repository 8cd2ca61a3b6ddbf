"""Train the quickstart's small chat tokenizer (byte-level BPE, Qwen-style chat format).

The tokenizer is a byte-level BPE (as in GPT-2 and Qwen2) trained with the ``tokenizers``
library, with every digit split into its own token (as Qwen2's pre-tokenizer does), so
numbers are always spelled digit by digit: an addition model then sees the same digit
tokens whatever the number. The special tokens and chat markup follow Qwen2:
``<|endoftext|>`` (padding), ``<|im_start|>`` and ``<|im_end|>`` (end of a turn, the EOS).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# Each turn is "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt opens an
# assistant turn. Unlike Qwen2.5's template there is no default system turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Byte-level BPE starts from all 256 byte symbols; the special tokens come on top.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def train_chat_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int) -> Path:
    """Train a byte-level BPE on ``texts`` and save it as a transformers tokenizer directory.

    Pipeline: pre-tokenizer ``Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False)])``,
    BPE model trained with ``BpeTrainer`` from the full 256-byte alphabet plus the special
    tokens (ids 0, 1, 2 for ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), ByteLevel
    decoder. Any UTF-8 text round-trips: ``decode(encode(x)) == x``.

    The directory holds ``tokenizer.json`` and ``tokenizer_config.json`` (with
    ``eos_token="<|im_end|>"``, ``pad_token="<|endoftext|>"``, no BOS, the chat template
    :data:`CHAT_TEMPLATE`); ``AutoTokenizer.from_pretrained(out_dir)`` loads it. It is
    written to a temporary sibling and renamed into place, replacing an older directory.

    Args:
        texts: training corpus, one document per item (e.g. rendered chat transcripts).
        out_dir: the tokenizer directory to create.
        vocab_size: target vocabulary size including special tokens. The trained vocabulary
            can be smaller when the corpus offers fewer merges; use ``len(tokenizer)``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: ``vocab_size`` below :data:`MIN_VOCAB_SIZE` (259), or ``texts`` is empty.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"train_chat_tokenizer: vocab_size={vocab_size} is below {MIN_VOCAB_SIZE} "
            "(256 byte symbols + 3 special tokens of a byte-level BPE)"
        )
    corpus = list(texts)
    if not corpus:
        raise ValueError("train_chat_tokenizer: texts is empty; nothing to train on")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps character offsets covering the leading-space symbol.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        # Decoding must give back the exact text (no " ?" -> "?" style clean-up).
        clean_up_tokenization_spaces=False,
    )

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()  # not mkdtemp (0o700): the files get the process umask's permissions
    try:
        fast.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
