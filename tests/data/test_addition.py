"""The quickstart's addition splits: formats, correctness, held-out disjointness, determinism."""

from __future__ import annotations

import json
import re

import pytest

from data.addition import make_addition_datasets, wrong_sums

QUESTION = re.compile(r"^What is (\d\d) \+ (\d\d)\?$")
COUNTS = dict(num_sft=300, num_preference=120, num_rl=250, num_eval=80)


def _rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _operands(user_message: dict) -> tuple[int, int]:
    assert user_message["role"] == "user"
    m = QUESTION.match(user_message["content"])
    assert m, user_message
    a, b = int(m.group(1)), int(m.group(2))
    assert 10 <= a <= 99 and 10 <= b <= 99
    return a, b


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    out = tmp_path_factory.mktemp("addition")
    return make_addition_datasets(out, seed=7, **COUNTS)


def test_files_and_row_counts(splits):
    assert sorted(splits) == ["preference", "rl_eval", "rl_train", "sft"]
    assert [p.name for p in splits.values()] == ["sft.jsonl", "preference.jsonl", "rl_train.jsonl", "rl_eval.jsonl"]
    assert len(_rows(splits["sft"])) == 300
    assert len(_rows(splits["preference"])) == 120
    assert len(_rows(splits["rl_train"])) == 250
    assert len(_rows(splits["rl_eval"])) == 80
    # Atomic writes leave no temporary siblings behind.
    assert sorted(p.name for p in splits["sft"].parent.iterdir()) == sorted(p.name for p in splits.values())


def test_sft_rows_are_correct_sums(splits):
    for row in _rows(splits["sft"]):
        assert set(row) == {"messages"}
        user, assistant = row["messages"]
        a, b = _operands(user)
        assert assistant == {"role": "assistant", "content": str(a + b)}


def test_preference_rejected_is_a_plausible_wrong_sum(splits):
    kinds = set()
    for row in _rows(splits["preference"]):
        assert set(row) == {"prompt", "chosen", "rejected"}
        (user,) = row["prompt"]
        a, b = _operands(user)
        s = a + b
        assert row["chosen"] == str(s)
        r = int(row["rejected"])
        assert r != s
        assert r in (s - 1, s + 1, s - 10, s + 10, int(str(s)[::-1]))
        kinds.add(abs(r - s) if abs(r - s) in (1, 10) else "swap")
    assert kinds == {1, 10, "swap"}  # all three error kinds occur in 120 rows


def test_wrong_sums_by_hand():
    # 47 + 38 = 85: off by one, off by ten, digits reversed.
    assert wrong_sums(47, 38) == [84, 86, 75, 95, 58]
    # 22 + 33 = 55 reads the same reversed, so the digit swap is left out.
    assert wrong_sums(22, 33) == [54, 56, 45, 65]
    # 100 reversed is "001" = 1: still a distinct wrong answer.
    assert wrong_sums(50, 50) == [99, 101, 90, 110, 1]


def test_eval_prompts_are_held_out(splits):
    eval_pairs = [_operands(r["prompt"][0]) for r in _rows(splits["rl_eval"])]
    assert len(set(eval_pairs)) == 80
    for r in _rows(splits["rl_eval"]):
        a, b = _operands(r["prompt"][0])
        assert r["label"] == str(a + b)
    held_out = {frozenset(p) for p in eval_pairs}
    train_pairs = [_operands(r["messages"][0]) for r in _rows(splits["sft"])]
    train_pairs += [_operands(r["prompt"][0]) for r in _rows(splits["preference"])]
    train_pairs += [_operands(r["prompt"][0]) for r in _rows(splits["rl_train"])]
    assert len(train_pairs) == 300 + 120 + 250
    # Neither order of a held-out pair is trained on.
    assert not [p for p in train_pairs if frozenset(p) in held_out]


def test_deterministic_given_seed(tmp_path, splits):
    again = make_addition_datasets(tmp_path / "again", seed=7, **COUNTS)
    other = make_addition_datasets(tmp_path / "other", seed=8, **COUNTS)
    for name in splits:
        assert again[name].read_bytes() == splits[name].read_bytes()
        assert other[name].read_bytes() != splits[name].read_bytes()


def test_bad_counts_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="num_sft"):
        make_addition_datasets(tmp_path, num_sft=0, num_preference=1, num_rl=1, num_eval=1, seed=0)
    with pytest.raises(ValueError, match="num_rl=9000"):
        make_addition_datasets(tmp_path, num_sft=1, num_preference=1, num_rl=9000, num_eval=1, seed=0)
