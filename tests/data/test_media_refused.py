"""Multimodal rows are refused, not read as text: LLaMA-Factory's ``images`` / ``videos`` /
``audios`` fields (its mllm demo layouts) and image, audio or video content parts (OpenAI's
``image_url``, ``input_audio``), in every format and kind, each as one error naming file,
line and field."""

from __future__ import annotations

import json

import pytest

from data.validate import DataValidationError, check_threshold, validate_dataset

TEXT = {"messages": [{"role": "user", "content": "Who are they?"}, {"role": "assistant", "content": "Two players."}]}


def _refusal(medium: str, key: str) -> str:
    return (
        f"{medium}s are not supported (training is text-only): the {medium}s would be dropped and '<{medium}>' "
        f"placeholders trained as text; remove the '{key}' field (and the placeholders), remove these rows, or "
        "use a text-only dataset"
    )


def _write(tmp_path, *records) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# LLaMA-Factory's mllm_demo.json / mllm_video_demo.json / mllm_audio_demo.json rows.
MLLM = [
    (
        "image",
        "images",
        {
            "messages": [
                {"content": "<image>Who are they?", "role": "user"},
                {"content": "They're Kane and Gretzka from Bayern Munich.", "role": "assistant"},
            ],
            "images": ["mllm_demo_data/1.jpg"],
        },
    ),
    (
        "video",
        "videos",
        {
            "messages": [
                {"content": "<video>Why is this video funny?", "role": "user"},
                {"content": "Because a baby is reading.", "role": "assistant"},
            ],
            "videos": ["mllm_demo_data/1.mp4"],
        },
    ),
    (
        "audio",
        "audios",
        {
            "messages": [
                {"content": "<audio>What is the speaker doing?", "role": "user"},
                {"content": "The speaker is talking about a game.", "role": "assistant"},
            ],
            "audios": ["mllm_demo_data/1.mp3"],
        },
    ),
]


@pytest.mark.parametrize("medium, key, record", MLLM)
def test_llamafactory_multimodal_rows(tmp_path, medium, key, record):
    path = _write(tmp_path, TEXT, record, TEXT)
    result = validate_dataset(path, "sft")
    assert result.format == "messages"
    assert [(e.file, e.line, e.field, e.message) for e in result.errors] == [(path, 2, key, _refusal(medium, key))]
    assert len(result.rows) == 2 and "<" not in json.dumps(result.rows)


def test_a_whole_multimodal_file_is_one_clear_failure(tmp_path):
    image = MLLM[0][2]
    path = _write(tmp_path, image, image)
    result = validate_dataset(path, "sft")
    with pytest.raises(DataValidationError) as e:
        check_threshold(result)
    assert str(e.value).splitlines() == [
        f"{path}: 2 of 2 records bad (1.0000 > data.max_bad_fraction = 0.0)",
        f"{path}: no valid sft rows",
        f"{path}:1: images: {_refusal('image', 'images')}",
        f"{path}:2: images: {_refusal('image', 'images')}",
    ]


@pytest.mark.parametrize(
    "kind, record, key",
    [
        (
            "sft",
            {
                "conversations": [
                    {"from": "human", "value": "<image>What is this?"},
                    {"from": "gpt", "value": "A cat."},
                ],
                "images": ["cat.jpg"],
            },
            "images",
        ),
        ("sft", {"instruction": "<image>Describe it.", "output": "A cat.", "images": ["cat.jpg"]}, "images"),
        (
            "sft",
            {
                "id": "1",
                "image": "coco/1.jpg",
                "conversations": [  # LLaVA's layout
                    {"from": "human", "value": "<image>\nWhat is this?"},
                    {"from": "gpt", "value": "A cat."},
                ],
            },
            "image",
        ),
        (
            "preference",
            {
                "conversations": [{"from": "human", "value": "<image>What is this?"}],
                "chosen": {"from": "gpt", "value": "A cat."},
                "rejected": {"from": "gpt", "value": "A dog."},
                "images": ["cat.jpg"],
            },
            "images",
        ),
        ("rl", {"prompt": "<image>How many cats?", "label": "2", "images": ["cats.jpg"]}, "images"),
    ],
)
def test_every_format_and_kind_refuses_media(tmp_path, kind, record, key):
    path = _write(tmp_path, record)
    result = validate_dataset(path, kind)
    assert [(e.line, e.field, e.message) for e in result.errors] == [(1, key, _refusal(key.rstrip("s"), key))]


def test_empty_media_fields_are_text_rows(tmp_path):
    path = _write(tmp_path, {**TEXT, "images": []}, {**TEXT, "videos": None})
    result = validate_dataset(path, "sft")
    assert result.errors == [] and result.rows == [TEXT, TEXT]


@pytest.mark.parametrize(
    "part, medium",
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image"),  # OpenAI chat
        ({"type": "input_audio", "input_audio": {"data": "UklGR...", "format": "wav"}}, "audio"),
        ({"type": "video", "value": "clip.mp4"}, "video"),
    ],
)
def test_media_content_parts(tmp_path, part, medium):
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]},
            {"role": "assistant", "content": "A cat."},
        ]
    }
    result = validate_dataset(_write(tmp_path, record), "sft")
    assert [(e.line, e.field, e.message) for e in result.errors] == [
        (
            1,
            "messages[0].content[1].type",
            f"{medium}s are not supported (training is text-only; content part type "
            f"{part['type']!r}): remove the part (keep the text parts) or the row, or "
            "use a text-only dataset",
        )
    ]
