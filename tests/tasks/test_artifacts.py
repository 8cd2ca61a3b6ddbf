"""ArtifactStore: manifests, lookup, ordering, verification and atomic publish.

Every behaviour runs on a local directory and on an fsspec ``memory://`` root (the
non-local code path: per-file moves, downloads into the local cache). Checksums are
recomputed here with hashlib, independently of the store.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import fsspec.implementations.memory
import pytest

import tasks.artifacts as artifacts
from tasks.artifacts import MANIFEST, ArtifactError, ArtifactStore

FP_A = hashlib.sha256(b"fingerprint a").hexdigest()
FP_B = hashlib.sha256(b"fingerprint b").hexdigest()
FP_C = hashlib.sha256(b"fingerprint c").hexdigest()


def _make_workdir(path: Path, seed: int) -> dict[str, bytes]:
    """A stage output: binary weights, a JSON config, and nested files (one of them a
    stage-owned ``manifest.json`` that must be treated as data). Returns path -> bytes."""
    rng = random.Random(seed)
    files = {
        "model/weights.bin": bytes(rng.randrange(256) for _ in range(3000)),
        "model/config.json": json.dumps({"hidden_size": 64, "seed": seed}).encode(),
        "model/manifest.json": b'{"owned_by": "the stage"}',
        "report.md": f"# report {seed}\n".encode(),
        "empty.txt": b"",
    }
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return files


def _expected_table(files: dict[str, bytes]) -> list[dict]:
    return [{"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for rel, data in sorted(files.items())]


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path) -> ArtifactStore:
    if request.param == "local":
        yield ArtifactStore(str(tmp_path / "artifacts"), cache_dir=tmp_path / "cache")
        return
    root = f"memory://posttrain-test-{uuid.uuid4().hex}"
    s = ArtifactStore(root, cache_dir=tmp_path / "cache")
    yield s
    if s.fs.exists(s.base):
        s.fs.rm(s.base, recursive=True)


def _workdir(tmp_path: Path, name: str, seed: int) -> tuple[Path, dict[str, bytes]]:
    w = tmp_path / name
    w.mkdir()
    return w, _make_workdir(w, seed)


def _stage_entries(store: ArtifactStore, stage: str) -> list[str]:
    d = f"{store.base}/{stage}"
    if not store.fs.exists(d):
        return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in store.fs.ls(d, detail=False))


def _write(store: ArtifactStore, url: str, data: bytes) -> None:
    store.fs.makedirs(url.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe(url, data)


def _read(store: ArtifactStore, ref, rel: str) -> bytes:
    with store.fs.open(f"{store.base}/{ref.stage}/{ref.artifact_id}/{rel}", "rb") as f:
        return f.read()


def test_publish_writes_full_manifest_and_files(store, tmp_path):
    work, files = _workdir(tmp_path, "work", seed=1)
    assert store.find("sft", FP_A) is None
    assert store.list("sft") == []
    assert store.latest("sft") is None

    before = datetime.now(timezone.utc)
    extra = {"inputs": {"convert": FP_B}, "config": {"sft": {"steps": 3, "lr": 0.001}}, "metrics": {"train/loss": 1.25}}
    ref = store.publish("sft", FP_A, work, extra)
    after = datetime.now(timezone.utc)

    assert ref.stage == "sft"
    assert ref.artifact_id == "sft-" + FP_A[:16]
    assert ref.fingerprint == FP_A
    assert store.find("sft", FP_A) == ref
    assert store.find("sft", FP_B) is None

    m = store.manifest(ref)
    assert m["stage"] == "sft"
    assert m["artifact_id"] == "sft-" + FP_A[:16]
    assert m["fingerprint"] == FP_A
    assert m["inputs"] == {"convert": FP_B}
    assert m["config"] == {"sft": {"steps": 3, "lr": 0.001}}
    assert m["metrics"] == {"train/loss": 1.25}
    created = datetime.fromisoformat(m["created_at"])
    assert before - timedelta(milliseconds=1) <= created <= after
    # Every file, the stage's own nested manifest.json included, with hashlib's sha256.
    assert m["files"] == _expected_table(files)
    for rel, data in files.items():
        assert _read(store, ref, rel) == data
    assert json.loads(_read(store, ref, MANIFEST)) == m
    assert _stage_entries(store, "sft") == [ref.artifact_id]  # no temporary left behind
    store.verify(ref)

    local = store.local_path(ref)
    got = {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    assert got.pop(MANIFEST) == _read(store, ref, MANIFEST)
    assert got == files


def test_memory_ref_uri_names_the_protocol(tmp_path):
    root = f"memory://posttrain-test-{uuid.uuid4().hex}"
    store = ArtifactStore(root, cache_dir=tmp_path / "cache")
    assert not store.is_local
    ref = store.ref("rm", FP_C)
    assert ref.uri == f"memory://{store.base}/rm/rm-{FP_C[:16]}"
    local = ArtifactStore(str(tmp_path / "a"))
    assert local.is_local
    assert local.ref("rm", FP_C).uri == str(tmp_path / "a" / "rm" / f"rm-{FP_C[:16]}")


def test_same_fingerprint_published_twice_keeps_the_first(store, tmp_path):
    w1, files1 = _workdir(tmp_path, "w1", seed=1)
    w2, files2 = _workdir(tmp_path, "w2", seed=2)
    assert files1["model/weights.bin"] != files2["model/weights.bin"]
    ref1 = store.publish("sft", FP_A, w1, {"metrics": {"run": 1}})
    first = store.manifest(ref1)
    ref2 = store.publish("sft", FP_A, w2, {"metrics": {"run": 2}})
    assert ref2 == ref1
    assert store.manifest(ref1) == first
    assert _read(store, ref1, "model/weights.bin") == files1["model/weights.bin"]
    assert [m["metrics"] for m in store.list("sft")] == [{"run": 1}]
    assert _stage_entries(store, "sft") == [ref1.artifact_id]


def test_list_and_latest_follow_publish_order(store, tmp_path):
    # Published in an order that differs from the ids' alphabetical order.
    order = [FP_C, FP_A, FP_B]
    refs = []
    for i, fp in enumerate(order):
        w, _ = _workdir(tmp_path, f"w{i}", seed=i)
        refs.append(store.publish("rl", fp, w, {"metrics": {"i": i}}))
    assert sorted(r.artifact_id for r in refs) != [r.artifact_id for r in refs]
    listed = store.list("rl")
    assert [m["artifact_id"] for m in listed] == [r.artifact_id for r in refs]
    assert [m["metrics"]["i"] for m in listed] == [0, 1, 2]
    times = [datetime.fromisoformat(m["created_at"]) for m in listed]
    assert times == sorted(times) and len(set(times)) == 3
    assert store.latest("rl")["artifact_id"] == refs[-1].artifact_id
    assert store.list("sft") == [] and store.latest("sft") is None


def test_leftovers_are_never_listed_or_found(store, tmp_path):
    work, files = _workdir(tmp_path, "work", seed=1)
    aid = store.artifact_id("sft", FP_A)
    stage_dir = f"{store.base}/sft"
    # A killed publish: a hidden temporary holding a complete-looking copy with manifest.
    tmp_leftover = f"{stage_dir}/.tmp-{aid}-deadbeef"
    store.fs.put(str(work), tmp_leftover, recursive=True)
    _write(store, f"{tmp_leftover}/{MANIFEST}", json.dumps({"artifact_id": aid, "created_at": "2000-01-01"}).encode())
    # A partial artifact directory without manifest (a crash mid-move on an object store).
    _write(store, f"{stage_dir}/{aid}/model/weights.bin", b"partial")
    _write(store, f"{stage_dir}/{aid}/stray.bin", b"not part of the artifact")
    # Another version's partial directory, not the fingerprint being looked up.
    _write(store, f"{stage_dir}/sft-{FP_B[:16]}/report.md", b"half")

    assert store.find("sft", FP_A) is None
    assert store.find("sft", FP_B) is None
    assert store.list("sft") == []
    assert store.latest("sft") is None
    with pytest.raises(ArtifactError, match=aid):
        store.manifest(store.ref("sft", FP_A))

    ref = store.publish("sft", FP_A, work, {})
    assert store.find("sft", FP_A) == ref
    assert [m["artifact_id"] for m in store.list("sft")] == [aid]
    store.verify(ref)
    assert _read(store, ref, "model/weights.bin") == files["model/weights.bin"]
    # The partial leftover was replaced, not merged into the artifact.
    assert not store.fs.exists(f"{stage_dir}/{aid}/stray.bin")


def test_verify_names_the_changed_file(store, tmp_path):
    work, files = _workdir(tmp_path, "work", seed=1)
    ref = store.publish("convert", FP_A, work, {})
    store.verify(ref)
    target = f"{store.base}/convert/{ref.artifact_id}/model/weights.bin"
    data = bytearray(files["model/weights.bin"])
    data[1234] ^= 0x01  # one bit of one byte; the size stays the same
    _write(store, target, bytes(data))
    with pytest.raises(ArtifactError, match=r"checksum mismatch for model/weights\.bin while verifying convert-"):
        store.verify(ref)
    store.fs.rm(target)
    with pytest.raises(ArtifactError, match=r"model/weights\.bin is missing"):
        store.verify(ref)


def test_local_path_of_missing_artifact_names_it(store):
    ref = store.ref("export", FP_B)
    with pytest.raises(ArtifactError, match=f"artifact export-{FP_B[:16]} is not published"):
        store.local_path(ref)


def test_verify_of_unpublished_artifact_names_it(store):
    with pytest.raises(ArtifactError, match=f"export-{FP_C[:16]} has no manifest.json"):
        store.verify(store.ref("export", FP_C))


def test_crash_during_local_copy_leaves_nothing(tmp_path, monkeypatch):
    store = ArtifactStore(str(tmp_path / "artifacts"))
    work, files = _workdir(tmp_path, "work", seed=1)
    real_copytree = shutil.copytree

    # Test double for a failure this machine cannot be made to produce on demand:
    # the disk fills up after one file of the artifact has been copied.
    def copy_one_then_fail(src, dst, *a, **k):
        Path(dst, "model").mkdir(parents=True)
        shutil.copy2(Path(src, "model", "weights.bin"), Path(dst, "model", "weights.bin"))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(artifacts.shutil, "copytree", copy_one_then_fail)
    with pytest.raises(OSError, match="No space left"):
        store.publish("sft", FP_A, work, {})
    assert store.find("sft", FP_A) is None
    assert store.list("sft") == []
    assert _stage_entries(store, "sft") == []  # the temporary was removed

    monkeypatch.setattr(artifacts.shutil, "copytree", real_copytree)
    ref = store.publish("sft", FP_A, work, {})
    assert store.find("sft", FP_A) == ref
    store.verify(ref)
    assert store.manifest(ref)["files"] == _expected_table(files)


def test_corrupted_copy_is_rejected_and_not_published(tmp_path, monkeypatch):
    store = ArtifactStore(str(tmp_path / "artifacts"))
    work, _ = _workdir(tmp_path, "work", seed=1)
    real_copytree = shutil.copytree

    # Test double: a transfer that silently flips one byte (bad disk or network).
    def corrupting_copytree(src, dst, *a, **k):
        real_copytree(src, dst, *a, **k)
        if not Path(dst).name.startswith(".tmp-"):  # shutil recurses through this double
            return
        p = Path(dst, "model", "config.json")
        data = bytearray(p.read_bytes())
        data[0] ^= 0xFF
        p.write_bytes(bytes(data))

    monkeypatch.setattr(artifacts.shutil, "copytree", corrupting_copytree)
    with pytest.raises(ArtifactError, match=r"checksum mismatch for model/config\.json while publishing sft-"):
        store.publish("sft", FP_A, work, {})
    assert store.find("sft", FP_A) is None
    assert _stage_entries(store, "sft") == []


def test_crash_during_remote_move_is_never_seen_as_published(tmp_path, monkeypatch):
    store = ArtifactStore(f"memory://posttrain-test-{uuid.uuid4().hex}", cache_dir=tmp_path / "cache")
    work, files = _workdir(tmp_path, "work", seed=1)
    mem_cls = type(store.fs)
    real_cp = mem_cls.cp_file
    # Test double: the connection drops while the last data file is copied into place
    # (object stores move a directory file by file).
    def drop_on_report(self, path1, path2, **kw):
        if "/.tmp-" not in path2 and path2.endswith("report.md"):
            raise ConnectionError("connection reset")
        return real_cp(self, path1, path2, **kw)

    monkeypatch.setattr(mem_cls, "cp_file", drop_on_report)
    try:
        with pytest.raises(ConnectionError):
            store.publish("sft", FP_A, work, {})
        assert store.find("sft", FP_A) is None
        assert store.list("sft") == []
        monkeypatch.setattr(mem_cls, "cp_file", real_cp)
        ref = store.publish("sft", FP_A, work, {})
        assert store.find("sft", FP_A) == ref
        store.verify(ref)
        assert _stage_entries(store, "sft") == [ref.artifact_id]
        assert sorted(p.rsplit(f"{ref.artifact_id}/", 1)[1] for p in store.fs.find(f"{store.base}/sft")) == sorted(
            [*files, MANIFEST]
        )
    finally:
        store.fs.rm(store.base, recursive=True)


def test_concurrent_publisher_winning_the_rename_is_kept(tmp_path, monkeypatch):
    root = str(tmp_path / "artifacts")
    ours, theirs = ArtifactStore(root), ArtifactStore(root)
    w_ours, _ = _workdir(tmp_path, "ours", seed=1)
    w_theirs, files_theirs = _workdir(tmp_path, "theirs", seed=2)
    real_rename = os.rename
    raced = []

    # Test double for timing only: the other process publishes the same fingerprint
    # between our "already published?" check and our rename.
    def rename_after_other_process(src, dst):
        if not raced:
            raced.append(True)
            theirs.publish("sft", FP_A, w_theirs, {"metrics": {"who": "theirs"}})
        return real_rename(src, dst)

    monkeypatch.setattr(artifacts.os, "rename", rename_after_other_process)
    ref = ours.publish("sft", FP_A, w_ours, {"metrics": {"who": "ours"}})
    assert ref == ours.find("sft", FP_A)
    assert ours.manifest(ref)["metrics"] == {"who": "theirs"}
    assert (ours.local_path(ref) / "model" / "weights.bin").read_bytes() == files_theirs["model/weights.bin"]
    ours.verify(ref)
    assert _stage_entries(ours, "sft") == [ref.artifact_id]


def test_remote_download_cache_is_per_store_and_refreshed(tmp_path):
    cache = tmp_path / "cache"
    a = ArtifactStore(f"memory://posttrain-test-{uuid.uuid4().hex}", cache_dir=cache)
    b = ArtifactStore(f"memory://posttrain-test-{uuid.uuid4().hex}", cache_dir=cache)
    try:
        w1, f1 = _workdir(tmp_path, "w1", seed=1)
        w2, f2 = _workdir(tmp_path, "w2", seed=2)
        w3, f3 = _workdir(tmp_path, "w3", seed=3)
        ref_a = a.publish("sft", FP_A, w1, {})
        ref_b = b.publish("sft", FP_A, w2, {})
        assert ref_a.artifact_id == ref_b.artifact_id
        pa, pb = a.local_path(ref_a), b.local_path(ref_b)
        assert pa != pb
        assert (pa / "model" / "weights.bin").read_bytes() == f1["model/weights.bin"]
        assert (pb / "model" / "weights.bin").read_bytes() == f2["model/weights.bin"]
        assert a.local_path(ref_a) == pa  # second call: served from the cache

        # Deleted and republished under the same fingerprint: the cache must not serve the old bytes.
        a.fs.rm(f"{a.base}/sft/{ref_a.artifact_id}", recursive=True)
        a.publish("sft", FP_A, w3, {})
        assert (a.local_path(ref_a) / "model" / "weights.bin").read_bytes() == f3["model/weights.bin"]

        # A corrupt remote file is caught on download, naming it.
        _write(a, f"{a.base}/sft/{ref_a.artifact_id}/report.md", b"# tampered\n")
        with pytest.raises(ArtifactError, match=r"checksum mismatch for report\.md while downloading"):
            ArtifactStore(a.root, cache_dir=tmp_path / "fresh-cache").local_path(ref_a)
        assert list((tmp_path / "fresh-cache").rglob("*.bin")) == []
    finally:
        for s in (a, b):
            s.fs.rm(s.base, recursive=True)


def test_fsspec_memory_root_is_shared_between_store_instances(tmp_path):
    root = f"memory://posttrain-test-{uuid.uuid4().hex}"
    work, _ = _workdir(tmp_path, "work", seed=4)
    writer = ArtifactStore(root, cache_dir=tmp_path / "c1")
    try:
        ref = writer.publish("validate", FP_B, work, {"metrics": {"rows": 7}})
        reader = ArtifactStore(root, cache_dir=tmp_path / "c2")
        assert reader.find("validate", FP_B) == ref
        assert reader.latest("validate")["metrics"] == {"rows": 7}
        assert isinstance(reader.fs, fsspec.implementations.memory.MemoryFileSystem)
    finally:
        writer.fs.rm(writer.base, recursive=True)
