"""The stage runner never serves a stale result and reruns nothing it need not.

Each test runs real stage tasks (the validate stage on real LLaMA-Factory data) inside
Prefect flows against a temporary Prefect server, with the store on local disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_support import migrated_prefect_home
from prefect import flow
from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_API_URL, temporary_settings

from config.schema import PipelineConfig
from flows.pipeline import run_stage_task
from flows.prefect_server import prefect_api
from flows.status import stage_status
from tasks import validate
from tasks.artifacts import ArtifactStore, content_hash
from tasks.graph import stage
from tasks.runner import InputChanged, fingerprint_lock, input_hashes, run_stage

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def prefect_server(tmp_path_factory):
    """The temporary server a CLI command starts (``prefect_api``), on a database of its own."""
    db = migrated_prefect_home(tmp_path_factory.mktemp("prefect-home")) / "prefect.db"
    with temporary_settings(
        updates={PREFECT_API_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{db}"}, restore_defaults={PREFECT_API_URL}
    ):
        with prefect_api():
            yield


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Stages write their pointers under ``outputs/<run>/`` of the working directory: the test's own."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def data(tmp_path, fixtures_dir) -> Path:
    """A real alpaca-format SFT file (LLaMA-Factory's demo set), copied so tests may edit it."""
    rows = json.loads((fixtures_dir / "llamafactory-demo" / "alpaca_en_demo.json").read_text())[:40]
    path = tmp_path / "sft.json"
    path.write_text(json.dumps(rows))
    return path


def config(tmp_path: Path, sft_path: Path, root: str | None = None, **data) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "run": {
                "name": "t",
                "artifact_root": root or str(tmp_path / "artifacts"),
                "checkpoint_root": str(tmp_path / "checkpoints"),
            },
            "wandb": {"enabled": False},
            "data": {"sft": {"path": str(sft_path), "format": "alpaca"}, **data},
            "model": {"source": "m"},
        }
    )


@flow
def validate_flow(cfg: PipelineConfig) -> dict:
    """The pipeline's own way to run a stage task (with its cache-bypass and clean-up)."""
    state, ref = run_stage_task(cfg, "validate", {})
    return {"state": state.name, "ref": ref}


def rows_in(store: ArtifactStore, ref) -> list[dict]:
    return [json.loads(line) for line in (store.local_path(ref) / "sft.jsonl").read_text().splitlines()]


# --- 1. a data file changed while validate ran --------------------------------------------------


def test_a_file_changed_while_the_stage_reads_it_publishes_nothing(tmp_path, data):
    """The fingerprint is taken, then the file changes before the stage reads it. Before,
    the artifact held the new rows under the old file's fingerprint; restoring the old
    file then gave a Cached stage with the wrong rows, for good."""
    cfg = config(tmp_path, data)
    spec = validate.SPEC
    original = data.read_bytes()
    edited = json.loads(original)[:10]

    def build_after_an_edit(ctx):
        data.write_text(json.dumps(edited))  # a writer got in between fingerprint and read
        return validate.validate.fn.build(ctx)

    @flow
    def one_stage():
        return run_stage(spec, build_after_an_edit, cfg, {})

    with pytest.raises(InputChanged, match=rf"{data}.*changed while the stage was running; nothing was published"):
        one_stage()
    assert (
        not (tmp_path / "artifacts" / "validate").exists()
        or [p.name for p in (tmp_path / "artifacts" / "validate").iterdir()] == []
    )
    data.write_bytes(original)  # the old file is back: the stage builds the old rows
    out = validate_flow(cfg)
    store = ArtifactStore(cfg.run.artifact_root)
    assert out["state"] == "Completed" and len(rows_in(store, out["ref"])) == 40


# --- 3. the cache key includes the store -------------------------------------------------------


def test_configs_differing_only_in_the_store_do_not_share_a_cache_entry(tmp_path, data):
    a = config(tmp_path, data, root=str(tmp_path / "store_a"))
    b = config(tmp_path, data, root=str(tmp_path / "store_b"))
    first = validate_flow(a)
    second = validate_flow(b)
    assert first["state"] == "Completed" and second["state"] == "Completed"  # b computed, in its own store
    assert first["ref"].artifact_id == second["ref"].artifact_id  # same inputs: same id ...
    assert second["ref"].uri.startswith(str(tmp_path / "store_b"))  # ... but b's ref points into b
    assert (tmp_path / "store_b" / "validate" / second["ref"].artifact_id / "manifest.json").is_file()
    assert validate_flow(b)["state"] == "Cached"


# --- early cut-off ------------------------------------------------------------------------


def test_a_byte_identical_rebuild_leaves_downstream_fingerprints_unchanged(tmp_path, data):
    """max_bad_fraction changes validate's fingerprint (it can change what passes), but with
    no bad rows the rebuilt files are byte-identical: sft's fingerprint, which uses
    validate's content hash, stays, so sft would be Cached."""
    cfg = config(tmp_path, data)
    relaxed = config(tmp_path, data, max_bad_fraction=0.05)
    one, two = validate_flow(cfg), validate_flow(relaxed)
    assert one["ref"].fingerprint != two["ref"].fingerprint and two["state"] == "Completed"
    assert one["ref"].content_hash == two["ref"].content_hash
    sft_spec, _ = stage("sft")
    convert = {"convert": "c" * 64}
    assert sft_spec.fingerprint(cfg, {**input_hashes({"validate": one["ref"]}), **convert}) == sft_spec.fingerprint(
        relaxed, {**input_hashes({"validate": two["ref"]}), **convert}
    )
    # The content hash is the files' (hand-computed from the manifest's table), not the times.
    manifest = ArtifactStore(cfg.run.artifact_root).manifest(two["ref"])
    assert manifest["content_hash"] == content_hash(manifest["files"]) == two["ref"].content_hash
    assert manifest["created_at"] != ArtifactStore(cfg.run.artifact_root).manifest(one["ref"])["created_at"]


# --- 4. status on the current fingerprint; broken artifacts are rebuilt -----------------------------


def _flip_16_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 16):
        data[i] ^= 0x20
    path.write_bytes(bytes(data))


def test_status_reports_the_current_fingerprint_and_checks_files(tmp_path, data):
    cfg = config(tmp_path, data)
    other = config(tmp_path, data, max_bad_fraction=0.05)
    first = validate_flow(cfg)["ref"]
    validate_flow(other)  # a newer version of the stage, for another config
    row = stage_status(cfg)[0]
    # The newest artifact is the other config's; status speaks of this config's.
    assert row["stage"] == "validate" and row["latest"] != first.artifact_id
    assert (row["state"], row["up_to_date"], row["artifact_id"]) == ("published", True, first.artifact_id)

    sft_file = Path(first.uri) / "sft.jsonl"
    _flip_16_bytes(sft_file)  # same size: only a re-hash sees it
    assert stage_status(cfg)[0]["up_to_date"] is True
    verified = stage_status(cfg, verify=True)[0]
    assert verified["state"] == "broken" and "sft.jsonl" in verified["problem"] and not verified["up_to_date"]

    sft_file.write_bytes(sft_file.read_bytes()[:-5])  # truncated: the plain size check sees it
    row = stage_status(cfg)[0]
    assert row["state"] == "broken" and "sft.jsonl" in row["problem"]
    out = validate_flow(cfg)  # a broken cached output is rebuilt, not served
    assert out["state"] == "Completed" and out["ref"].artifact_id == first.artifact_id
    assert len(rows_in(ArtifactStore(cfg.run.artifact_root), out["ref"])) == 40
    assert stage_status(cfg, verify=True)[0]["state"] == "published"


def test_a_truncated_manifest_names_its_file_and_is_rebuilt(tmp_path, data):
    cfg = config(tmp_path, data)
    ref = validate_flow(cfg)["ref"]
    old = tmp_path / "artifacts" / "validate" / "validate-0123456789abcdef"  # an old, unrelated version
    old.mkdir()
    (old / "manifest.json").write_text('{"stage": "validate", "artifact_id": "valid')
    assert stage_status(cfg)[0]["state"] == "published"  # the unrelated broken one is skipped
    manifest = Path(ref.uri) / "manifest.json"
    manifest.write_text(manifest.read_text()[:200])
    row = stage_status(cfg)[0]
    assert row["state"] == "broken" and "manifest.json" in row["problem"]
    out = validate_flow(cfg)
    assert out["state"] == "Completed" and json.loads(manifest.read_text())["artifact_id"] == ref.artifact_id


# --- leftovers of a kill after the publish ------------------------------------------------------


def test_a_cache_hit_removes_what_a_killed_attempt_left(tmp_path, data):
    """Killed after its publish but before its clean-up, a stage left its resume directory
    and its work directory; the next run is Cached (Prefect does not even run the task),
    and still removes them."""
    cfg = config(tmp_path, data)
    ref = validate_flow(cfg)["ref"]
    parent = tmp_path / "checkpoints" / "validate"
    resume = parent / ref.fingerprint[:16]
    resume.mkdir(parents=True)
    (resume / "train_state.pt").write_bytes(b"x" * 1000)
    work = parent / f".work-{ref.fingerprint[:16]}-deadbeef"
    work.mkdir()
    (work / "sft.jsonl").write_text("partial")
    (parent / f"{work.name}.lock").write_text("")
    live = parent / f".work-{ref.fingerprint[:16]}-1iveaaaa"  # a live attempt's: kept
    live.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
            str(parent / f"{live.name}.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert validate_flow(cfg)["state"] == "Cached"
        assert not resume.exists() and not work.exists() and live.is_dir()
    finally:
        holder.kill()
        holder.wait()


# --- two runs of one fingerprint ----------------------------------------------------------------


def test_a_second_run_of_a_fingerprint_waits_for_the_first(tmp_path):
    parent = tmp_path / "checkpoints" / "sft"
    script = (
        f"import sys, time; sys.path.insert(0, {str(REPO)!r})\n"
        "from pathlib import Path\nfrom tasks.runner import fingerprint_lock\n"
        f"with fingerprint_lock(Path({str(parent)!r}), 'abcdabcdabcdabcd', 'sft', print):\n"
        "    print('owner', flush=True)\n    time.sleep(3)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline().strip() == "owner"
    said: list[str] = []
    t0 = time.monotonic()
    with fingerprint_lock(parent, "abcdabcdabcdabcd", "sft sft-abcdabcdabcdabcd", said.append):
        waited = time.monotonic() - t0
        assert (parent / "abcdabcdabcdabcd.lock").read_text() == f"pid {os.getpid()} on {os.uname().nodename}\n"
    owner.wait()
    assert waited > 2.0  # the owner held it for 3 s after saying so
    assert said == [
        f"sft sft-abcdabcdabcdabcd is being built by another run (pid {owner.pid} on {os.uname().nodename}); "
        "waiting for it to finish"
    ]
    assert not (parent / "abcdabcdabcdabcd.lock").exists()  # nothing left behind
    # A killed owner's lock dies with it: no wait.
    killed = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().strip() == "owner"
    killed.kill()
    killed.wait()
    said.clear()
    with fingerprint_lock(parent, "abcdabcdabcdabcd", "sft", said.append):
        pass
    assert said == []
    shutil.rmtree(parent)
