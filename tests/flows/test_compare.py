"""``posttrain compare`` on small real artifacts (published into a real store, with hand-set
metrics, RL curves and evaluation samples): the pipeline an artifact id resolves to, the
metric deltas, the paired standard error (against the hand-computed value), the stage inputs
that differ, the PNG and the command's two outputs. Comparing two real pipeline runs is in
tests/flows/test_pipeline_e2e.py, two DVC experiments in tests/flows/test_dvc.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image

from flows.cli import main
from flows.compare import compare
from flows.compare_runs import from_artifact, stage_inputs
from tasks.artifacts import ArtifactRef, ArtifactStore

# Per prompt (4 prompts, 2 samples each): is each sample correct?
SFT = [[1, 0], [0, 0], [1, 1], [0, 0]]
RL = {"a": [[1, 1], [1, 0], [0, 0], [1, 0]], "b": [[1, 1], [1, 1], [1, 0], [0, 0]]}
LR = {"a": 1e-3, "b": 5e-4}
SCORES = {"a": [0.25, 0.5, 0.5], "b": [0.25, 0.5, 0.75]}  # critic/score/mean per RL step


def _publish(store: ArtifactStore, tmp: Path, stage: str, fp_char: str, files: dict[str, str], **fields) -> ArtifactRef:
    work = tmp / f"work-{stage}-{fp_char}"
    work.mkdir()
    for name, text in files.items():
        (work / name).write_text(text)
    fields.setdefault("inputs", {})
    fields["inputs"] = {k: v.model_dump() for k, v in fields["inputs"].items()}
    return store.publish(stage, fp_char * 64, work, {"code_version": "c" * 64, **fields})


def _samples(correct: dict[str, list[list[int]]], labels: list[str]) -> str:
    """samples.jsonl as the evaluate stage writes it (the default benchmark is rl_eval)."""
    lines = []
    for policy, per_prompt in correct.items():
        for p, samples in enumerate(per_prompt):
            for c in samples:
                lines.append(
                    json.dumps(
                        {
                            "benchmark": "rl_eval",
                            "policy": policy,
                            "index": len(lines),
                            "prompt_index": p,
                            "label": labels[p],
                            "prompt": [{"role": "user", "content": f"q{p}"}],
                            "correct": bool(c),
                            "reward": float(c),
                        }
                    )
                )
    return "\n".join(lines) + "\n"


def _accuracy(per_prompt: list[list[int]]) -> float:
    return sum(sum(s) / len(s) for s in per_prompt) / len(per_prompt)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One validate and sft artifact; two rl runs (a, b) differing in rl.optim.lr, each with
    its evaluate artifact on the same prompts; an export of a only; and rl run c whose
    evaluate scored other prompts (other labels)."""
    tmp = tmp_path_factory.mktemp("compare")
    store = ArtifactStore(str(tmp / "artifacts"))
    validate = _publish(
        store,
        tmp,
        "validate",
        "1",
        {"sft.jsonl": "{}\n"},
        config={"sft": {"path": "d/sft.jsonl"}},
        raw_inputs={"sft": {"path": "d/sft.jsonl", "sha256": "e" * 64}},
        metrics={"rows/sft": 10},
    )
    sft = _publish(
        store,
        tmp,
        "sft",
        "2",
        {"model.txt": "sft"},
        inputs={"validate": validate},
        config={"sft": {"steps": 6}, "seed": 0},
        metrics={"train/loss": 1.25},
    )
    refs = {}
    for run, fp, ev_fp, labels in (
        ("a", "3", "6", ["1", "2", "3", "4"]),
        ("b", "4", "7", ["1", "2", "3", "4"]),
        ("c", "5", "8", ["5", "6", "7", "8"]),
    ):
        scores = SCORES.get(run, [0.0, 0.0, 0.0])
        curve = "".join(
            json.dumps(
                {
                    "step": i + 1,
                    "critic/score/mean": s,
                    "actor/entropy": 2.0 - s,
                    "actor/ppo_kl": s / 10,
                    "response_length/mean": 4 + i,
                }
            )
            + "\n"
            for i, s in enumerate(scores)
        )
        rl = _publish(
            store,
            tmp,
            "rl",
            fp,
            {"metrics.jsonl": curve},
            inputs={"validate": validate, "sft": sft},
            config={"rl": {"optim": {"lr": LR.get(run, 1e-3)}, "steps": 3}, "seed": 0},
            metrics={"critic/score/mean": scores[-1], "step": 3},
        )
        rl_correct = RL.get(run, RL["a"])
        ev = _publish(
            store,
            tmp,
            "evaluate",
            ev_fp,
            {"samples.jsonl": _samples({"sft": SFT, "rl": rl_correct}, labels)},
            inputs={"validate": validate, "sft": sft, "rl": rl},
            config={"evaluate": {"num_prompts": 4}, "seed": 0},
            metrics={"sft/accuracy": _accuracy(SFT), "rl/accuracy": _accuracy(rl_correct), "rl/n": 4},
        )
        refs[run] = (rl, ev)
    _publish(
        store,
        tmp,
        "export",
        "a",
        {"bytes.txt": "x"},
        inputs={"rl": refs["a"][0]},
        config={"dtype": "float32"},
        metrics={"export/bytes": 1234},
    )
    return {
        "tmp": tmp,
        "store": store,
        "rl": {k: v[0] for k, v in refs.items()},
        "evaluate": {k: v[1] for k, v in refs.items()},
    }


def _row(doc: dict, stage: str, metric: str) -> dict:
    return next(r for r in doc["metrics"] if (r["stage"], r["metric"]) == (stage, metric))


def test_an_rl_artifact_resolves_to_what_it_was_built_from_and_what_was_built_from_it(store):
    run = from_artifact("a", store["store"], store["rl"]["a"].artifact_id)
    ids = {s: m["artifact_id"] for s, m in run.manifests.items()}
    assert ids == {
        "validate": "validate-" + "1" * 16,
        "sft": "sft-" + "2" * 16,
        "rl": store["rl"]["a"].artifact_id,
        "evaluate": store["evaluate"]["a"].artifact_id,
        "export": "export-" + "a" * 16,
    }
    assert run.notes == []
    evaluate = from_artifact("b", store["store"], store["evaluate"]["b"].artifact_id)  # upstream from evaluate
    assert (
        evaluate.manifests["rl"]["artifact_id"] == store["rl"]["b"].artifact_id and "export" not in evaluate.manifests
    )


def test_compare_gives_deltas_paired_errors_and_the_changed_key(store, tmp_path):
    runs = [from_artifact(k, store["store"], store["rl"][k].artifact_id) for k in ("a", "b")]
    doc = compare(runs, tmp_path / "curves.png")
    score = _row(doc, "rl", "critic/score/mean")
    assert score["values"] == [0.5, 0.75] and score["delta"] == [None, 0.25]
    acc = _row(doc, "evaluate", "rl/accuracy")
    assert acc["values"] == [0.5, 0.625] and acc["delta"] == [None, 0.125]
    assert _row(doc, "export", "export/bytes") == {
        "stage": "export",
        "metric": "export/bytes",
        "values": [1234, None],
        "delta": [None, None],
    }
    # Paired over prompts: d = per-prompt mean@2 of b minus a = [0, 0.5, 0.5, -0.5]; mean 0.125,
    # sample variance (0.125^2 + 0.375^2 + 0.375^2 + 0.625^2) / 3 = 0.6875 / 3, SE = sqrt(0.6875 / 3 / 4).
    paired = {p["policy"]: p for p in doc["paired"]}
    assert paired["rl"]["metric"] == "rl/accuracy" and paired["rl"]["n"] == 4 and paired["rl"]["run"] == 1
    assert paired["rl"]["delta"] == pytest.approx(0.125) and paired["rl"]["se"] == pytest.approx(math.sqrt(0.6875 / 12))
    assert (paired["sft"]["delta"], paired["sft"]["se"]) == (0.0, 0.0)  # the same sft policy
    assert doc["changed_keys"] == ["rl.optim.lr"]
    changed = {(c["stage"], c["key"]): c["values"] for c in doc["changed"]}
    assert changed[("rl", "rl.optim.lr")] == [1e-3, 5e-4]
    assert changed[("evaluate", "input rl")] == [store["rl"]["a"].artifact_id, store["rl"]["b"].artifact_id]
    assert not {s for s, _ in changed} & {"validate", "sft"}
    with Image.open(doc["curves_png"]) as png:
        assert (png.format, png.size) == ("PNG", (1100, 800))
        assert len(png.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 10  # lines drawn, not blank


def test_no_paired_error_between_evaluations_of_other_prompts(store, tmp_path):
    runs = [from_artifact(k, store["store"], store["rl"][k].artifact_id) for k in ("a", "c")]
    doc = compare(runs, None)
    assert doc["paired"] == [] and doc["curves_png"] is None
    assert _row(doc, "evaluate", "rl/accuracy")["delta"] == [None, 0.0]


def test_the_command_prints_a_table_or_one_json_document(store, tmp_path, capsys):
    a, b = store["rl"]["a"].artifact_id, store["rl"]["b"].artifact_id
    root = str(store["store"].root)
    assert main(["compare", a, b, "--artifact-root", root, "--out", str(tmp_path / "x.png")]) == 0
    out = capsys.readouterr().out
    assert f"posttrain compare: {a} vs {b}" in out and "stage inputs that differ" in out
    assert "+0.125 ± 0.24 (paired, n=4)" in out  # the rl/accuracy delta with its paired SE
    rl_lr = next(line for line in out.splitlines() if "rl.optim.lr" in line)
    assert "0.001" in rl_lr and "0.0005" in rl_lr
    assert (
        main(
            [
                "compare",
                a,
                str(Path(root) / "rl" / b),
                "--artifact-root",
                root,
                "--json",
                "--out",
                str(tmp_path / "y.png"),
            ]
        )
        == 0
    )  # an artifact directory works too
    doc = json.loads(capsys.readouterr().out)
    assert doc["changed_keys"] == ["rl.optim.lr"] and doc["curves_png"] == str(tmp_path / "y.png")
    assert main(["compare", a, "no-such-run", "--artifact-root", root]) == 2
    assert "'no-such-run' is not a config file, an artifact id" in capsys.readouterr().out


def test_stage_inputs_are_what_enters_the_fingerprint():
    manifest = {
        "config": {"sft": {"path": "d/x.jsonl", "format": "alpaca"}, "max_bad_fraction": 0.0},
        "raw_inputs": {"sft": {"path": "d/x.jsonl", "sha256": "f" * 64}},
        "inputs": {"convert": {"artifact_id": "convert-" + "0" * 16, "content_hash": "9" * 64}},
        "code_version": "c" * 64,
    }
    assert stage_inputs("validate", manifest) == {
        "data.sft.path": "(file sft)",
        "data.sft.format": "alpaca",
        "data.max_bad_fraction": 0.0,  # by content, not path
        "input convert": "convert-" + "0" * 16,
        "input convert content": "9" * 64,
        "file sft": "f" * 64,
        "code version": "c" * 64,
    }
    assert stage_inputs("rl", {"config": {"rl": {"steps": 3}, "seed": 1}})["run.seed"] == 1


def test_overrides_on_the_command_line_belong_to_the_config_before_them(tmp_path):
    from flows.compare import default_png, group_runs
    from flows.compare_runs import CompareError

    assert group_runs(["a.yaml", "rl.steps=5", "~prepare", "rl-0123456789abcdef", "b.yaml", "x=[1, 2]"]) == [
        ("a.yaml", ["rl.steps=5", "~prepare"]),
        ("rl-0123456789abcdef", []),
        ("b.yaml", ["x=[1, 2]"]),
    ]
    with pytest.raises(CompareError, match="rl.steps=5: an override follows the config file it changes"):
        group_runs(["rl.steps=5", "a.yaml"])
    assert default_png(
        ["configs/quickstart.yaml", "configs/quickstart.yaml rl.optim.lr=5e-4", "x/rl/rl-0123456789abcdef"]
    ) == Path("outputs/compare/quickstart_vs_quickstart-rl.optim.lr-5e-4_vs_rl-0123456789abcdef.png")


def test_the_stage_list_is_the_graphs():
    """flows.compare_runs keeps its own copy so that `posttrain` does not import the stages to start."""
    from flows.compare_runs import STAGE_NAMES
    from tasks.graph import STAGE_NAMES as GRAPH

    assert list(STAGE_NAMES) == GRAPH
