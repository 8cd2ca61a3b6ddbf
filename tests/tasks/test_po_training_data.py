"""The po stage trains KTO on the validate artifact's unpaired rows (kto.jsonl) when it has them,
and every other loss (and KTO without them) on its pairs (preference.jsonl)."""

from __future__ import annotations

from tasks.po import training_data


def test_kto_reads_the_unpaired_rows_when_the_artifact_has_them(tmp_path):
    (tmp_path / "preference.jsonl").write_text("")
    assert training_data(tmp_path, "kto") == tmp_path / "preference.jsonl"  # pairs only: split into two responses
    (tmp_path / "kto.jsonl").write_text("")
    assert training_data(tmp_path, "kto") == tmp_path / "kto.jsonl"
    for loss in ("dpo", "ipo", "simpo"):
        assert training_data(tmp_path, loss) == tmp_path / "preference.jsonl"
