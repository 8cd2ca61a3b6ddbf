"""ArtifactStore: manifests, content hashes, lookup, ordering, checks of broken artifacts,
verification, atomic publish, discarding and the clean-up of killed publishes.

Every behaviour runs on a local directory and on an fsspec ``memory://`` root (the
non-local code path: per-file moves, downloads into the local cache). Checksums are
recomputed here with hashlib, independently of the store. A killed publish is a real
subprocess killed with SIGKILL; the same on a real S3 server is in test_s3_store.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import cloudpickle
import fsspec.implementations.memory
import pytest
import yaml

import tasks.artifacts as artifacts
from tasks.artifacts import (
    MANIFEST,
    ArtifactCheck,
    ArtifactError,
    ArtifactRef,
    ArtifactStore,
    CorruptArtifact,
    content_hash,
)

REPO = Path(__file__).resolve().parents[2]

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
    return [
        {"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for rel, data in sorted(files.items())
    ]


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


def _unpublished_ref(store: ArtifactStore, stage: str, fp: str) -> ArtifactRef:
    """A ref naming an artifact that was never published (refs are only made by the store
    for published artifacts; this one stands for a stale ref kept by a caller)."""
    aid = store.artifact_id(stage, fp)
    return ArtifactRef(stage=stage, artifact_id=aid, fingerprint=fp, uri=store._uri(stage, aid), content_hash="0" * 64)


def _read(store: ArtifactStore, ref, rel: str) -> bytes:
    with store.fs.open(f"{store.base}/{ref.stage}/{ref.artifact_id}/{rel}", "rb") as f:
        return f.read()


def test_publish_writes_full_manifest_and_files(store, tmp_path):
    work, files = _workdir(tmp_path, "work", seed=1)
    assert store.find("sft", FP_A) is None
    assert store.list("sft") == []
    assert store.latest("sft") is None

    before = datetime.now(UTC)
    extra = {"inputs": {"convert": FP_B}, "config": {"sft": {"steps": 3, "lr": 0.001}}, "metrics": {"train/loss": 1.25}}
    ref = store.publish("sft", FP_A, work, extra)
    after = datetime.now(UTC)

    assert ref.stage == "sft"
    assert ref.artifact_id == "sft-" + FP_A[:16]
    assert ref.fingerprint == FP_A
    assert (
        ref.content_hash
        == hashlib.sha256(
            json.dumps(
                [[rel, hashlib.sha256(data).hexdigest()] for rel, data in sorted(files.items())], separators=(",", ":")
            ).encode()
        ).hexdigest()
    )
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
    assert m["content_hash"] == ref.content_hash
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
    work, _ = _workdir(tmp_path, "work", seed=1)
    try:
        ref = store.publish("rm", FP_C, work, {})
        assert (
            ref.uri
            == f"memory://{store.base}/rm/rm-{FP_C[:16]}"
            == f"{root.replace('memory://', 'memory:///')}/rm/rm-{FP_C[:16]}"
        )
        assert store.find("rm", FP_C).uri == ref.uri
    finally:
        store.fs.rm(store.base, recursive=True)
    local = ArtifactStore(str(tmp_path / "a"))
    assert local.is_local
    assert local.publish("rm", FP_C, work, {}).uri == str(tmp_path / "a" / "rm" / f"rm-{FP_C[:16]}")
    assert not hasattr(local, "ref")  # refs come from find()/publish()/check(): they carry the content hash


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
        store.manifest(_unpublished_ref(store, "sft", FP_A))

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
    with pytest.raises(
        CorruptArtifact, match=r"checksum mismatch for model/weights\.bin while verifying convert-"
    ) as info:
        store.verify(ref)
    assert (info.value.stage, info.value.artifact_id, info.value.file) == (
        "convert",
        ref.artifact_id,
        "model/weights.bin",
    )
    store.fs.rm(target)
    with pytest.raises(CorruptArtifact, match=r"model/weights\.bin is missing") as info:
        store.verify(ref)
    assert (info.value.stage, info.value.artifact_id, info.value.file) == (
        "convert",
        ref.artifact_id,
        "model/weights.bin",
    )


def test_local_path_of_missing_artifact_names_it(store):
    ref = _unpublished_ref(store, "export", FP_B)
    with pytest.raises(ArtifactError, match=f"artifact export-{FP_B[:16]} is not published"):
        store.local_path(ref)


def test_verify_of_unpublished_artifact_names_it(store):
    with pytest.raises(ArtifactError, match=f"export-{FP_C[:16]} has no manifest.json"):
        store.verify(_unpublished_ref(store, "export", FP_C))


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
    with pytest.raises(OSError, match=r"^disk full: publishing sft-\w+ at .* needs about 3\.0 KiB"):  # data.disk_full
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
        with pytest.raises(CorruptArtifact, match=r"checksum mismatch for report\.md while downloading") as info:
            ArtifactStore(a.root, cache_dir=tmp_path / "fresh-cache").local_path(ref_a)
        assert (info.value.stage, info.value.artifact_id, info.value.file) == ("sft", ref_a.artifact_id, "report.md")
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


# --- content hash ---------------------------------------------------------------------------

HELLO_SHA = "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"  # sha256(b"hello\n")
BYTES_SHA = "40aff2e9d2d8922e47afd4648e6967497158785fbd1da870e7110266bf944880"  # sha256(bytes(range(256)))


def test_content_hash_of_a_two_file_artifact_by_hand(store, tmp_path):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "sub" / "b.bin").write_bytes(bytes(range(256)))
    (work / "a.txt").write_bytes(b"hello\n")
    canonical = f'[["a.txt","{HELLO_SHA}"],["sub/b.bin","{BYTES_SHA}"]]'
    expected = hashlib.sha256(canonical.encode()).hexdigest()
    assert expected == "adeb72cc784fecd854d547d5b2cfec45be69b84b5ecc46d7a4bd629094da5a10"
    ref = store.publish("sft", FP_A, work, {"metrics": {"x": 1}})
    assert ref.content_hash == expected
    assert store.manifest(ref)["content_hash"] == expected
    assert store.find("sft", FP_A).content_hash == expected
    # Order of the table, sizes and other fields do not enter it.
    files = store.manifest(ref)["files"]
    assert content_hash(list(reversed(files))) == expected
    assert content_hash([{**f, "size": 0} for f in files]) == expected
    # Same bytes under another fingerprint and other manifest fields: the same content hash.
    assert store.publish("sft", FP_B, work, {"metrics": {"x": 2}}).content_hash == expected
    (work / "a.txt").write_bytes(b"hello!\n")
    assert store.publish("sft", FP_C, work, {}).content_hash != expected


def test_old_manifest_without_content_hash_gets_it_from_its_files(store, tmp_path):
    work, files = _workdir(tmp_path, "work", seed=3)
    ref = store.publish("sft", FP_A, work, {})
    m = store.manifest(ref)
    del m["content_hash"]
    _write(store, f"{store.base}/sft/{ref.artifact_id}/{MANIFEST}", json.dumps(m).encode())
    found = store.find("sft", FP_A)
    assert found == ref
    assert found.content_hash == content_hash(_expected_table(files))
    store.verify(found)


# --- check(): published, missing, broken ------------------------------------------------------


def test_check_states_and_problems(store, tmp_path):
    work, files = _workdir(tmp_path, "work", seed=1)
    missing = store.check("convert", FP_A)
    assert missing == ArtifactCheck("missing", None, None, None)
    ref = store.publish("convert", FP_A, work, {"metrics": {"m": 1}})
    ok = store.check("convert", FP_A)
    assert (ok.state, ok.ref, ok.problem) == ("published", ref, None)
    assert ok.manifest == store.manifest(ref) and ok.manifest["metrics"] == {"m": 1}
    assert store.check("convert", FP_A, verify=True) == ok
    adir = f"{store.base}/convert/{ref.artifact_id}"
    good_manifest = _read(store, ref, MANIFEST)

    # A file shorter than the manifest says (a truncated copy): found by the listing alone.
    _write(store, f"{adir}/model/weights.bin", files["model/weights.bin"][:812])
    c = store.check("convert", FP_A)
    assert (c.state, c.ref, c.problem) == ("broken", None, "model/weights.bin: 812 bytes, manifest says 3000")
    assert c.manifest == ok.manifest
    assert store.find("convert", FP_A) is None

    # A missing file.
    store.fs.rm(f"{adir}/model/weights.bin")
    c = store.check("convert", FP_A)
    assert (c.state, c.problem) == ("broken", "model/weights.bin is missing")
    assert store.find("convert", FP_A) is None

    # Same size, other bytes: only verify=True sees it.
    flipped = bytearray(files["model/weights.bin"])
    flipped[7] ^= 0x10
    _write(store, f"{adir}/model/weights.bin", bytes(flipped))
    assert store.check("convert", FP_A).state == "published"
    c = store.check("convert", FP_A, verify=True)
    assert (c.state, c.ref, c.problem) == ("broken", None, "checksum mismatch for model/weights.bin")
    _write(store, f"{adir}/model/weights.bin", files["model/weights.bin"])
    assert store.check("convert", FP_A, verify=True) == ok

    # A truncated manifest (a crash while writing it, a disk that filled up).
    _write(store, f"{adir}/{MANIFEST}", b'{"stage": "convert", "files": [')
    c = store.check("convert", FP_A)
    assert c == ArtifactCheck("broken", None, "manifest.json is not valid JSON (line 1 column 32)", None)
    assert store.find("convert", FP_A) is None
    _write(store, f"{adir}/{MANIFEST}", good_manifest[: len(good_manifest) // 2])
    c = store.check("convert", FP_A)
    assert c.state == "broken" and c.problem.startswith("manifest.json is not valid JSON (line ")
    _write(store, f"{adir}/{MANIFEST}", b"\xff\xfe{}")
    assert store.check("convert", FP_A).problem == "manifest.json is not valid UTF-8 (byte 0)"
    _write(store, f"{adir}/{MANIFEST}", b"[1, 2]")
    assert store.check("convert", FP_A).problem == "manifest.json is not a JSON object"
    _write(store, f"{adir}/{MANIFEST}", json.dumps({**ok.manifest, "files": None}).encode())
    assert store.check("convert", FP_A).problem == "manifest.json has no files table"

    # A manifest whose recorded content hash disagrees with its own files table.
    _write(store, f"{adir}/{MANIFEST}", json.dumps({**ok.manifest, "content_hash": "0" * 64}).encode())
    assert store.check("convert", FP_A).problem == "manifest.json: its content_hash does not match its files table"

    # Manifest removed: missing again, whatever files remain.
    store.fs.rm(f"{adir}/{MANIFEST}")
    assert store.check("convert", FP_A) == ArtifactCheck("missing")


def test_manifest_of_truncated_json_names_the_full_path(store, tmp_path):
    work, _ = _workdir(tmp_path, "work", seed=1)
    ref = store.publish("rm", FP_A, work, {})
    mpath = f"{store.base}/rm/{ref.artifact_id}/{MANIFEST}"
    _write(store, mpath, b'{"stage": "rm", "files": [')
    shown = mpath if store.is_local else f"memory://{mpath}"
    with pytest.raises(ArtifactError) as info:
        store.manifest(ref)
    assert str(info.value) == f"{shown} is not valid JSON (line 1 column 27) (artifact {ref.artifact_id})"
    assert not isinstance(info.value.__cause__, json.JSONDecodeError) and info.value.__suppress_context__
    with pytest.raises(ArtifactError, match="is not valid JSON"):
        store.verify(ref)
    if not store.is_local:
        with pytest.raises(ArtifactError, match=f"{shown} is not valid JSON"):
            store.local_path(ref)


def test_truncated_manifest_of_an_old_version_does_not_break_list(store, tmp_path, caplog):
    w1, _ = _workdir(tmp_path, "w1", seed=1)
    w2, _ = _workdir(tmp_path, "w2", seed=2)
    old = store.publish("rl", FP_A, w1, {"metrics": {"v": 1}})
    new = store.publish("rl", FP_B, w2, {"metrics": {"v": 2}})
    mpath = f"{store.base}/rl/{old.artifact_id}/{MANIFEST}"
    data = _read(store, old, MANIFEST)
    _write(store, mpath, data[:40])
    with caplog.at_level(logging.WARNING, logger="posttrain.artifacts"):
        listed = store.list("rl")
    warnings = [r for r in caplog.records if r.name == "posttrain.artifacts" and r.levelno == logging.WARNING]
    assert [m["artifact_id"] for m in listed] == [new.artifact_id]
    assert store.latest("rl")["metrics"] == {"v": 2}
    shown = mpath if store.is_local else f"memory://{mpath}"
    assert len(warnings) == 1 and shown in warnings[0].getMessage()
    assert "is not valid JSON (line " in warnings[0].getMessage()
    assert store.find("rl", FP_B) == new and store.find("rl", FP_A) is None


# --- CorruptArtifact --------------------------------------------------------------------------


def test_corrupt_artifact_survives_pickle_and_cloudpickle(tmp_path):
    store = ArtifactStore(str(tmp_path / "artifacts"))
    work, files = _workdir(tmp_path, "work", seed=1)
    ref = store.publish("sft", FP_A, work, {})
    Path(ref.uri, "report.md").write_bytes(b"# other\n")
    with pytest.raises(CorruptArtifact) as info:
        store.verify(ref)
    exc = info.value
    assert isinstance(exc, ArtifactError)
    assert "report.md" in str(exc) and ref.artifact_id in str(exc)
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        back = loads(dumps(exc))
        assert type(back) is CorruptArtifact
        assert (str(back), back.stage, back.artifact_id, back.file) == (str(exc), "sft", ref.artifact_id, "report.md")


def test_verify_refuses_a_ref_of_replaced_content(store, tmp_path):
    w1, _ = _workdir(tmp_path, "w1", seed=1)
    w2, _ = _workdir(tmp_path, "w2", seed=2)
    old = store.publish("sft", FP_A, w1, {})
    store.discard("sft", old.artifact_id)
    new = store.publish("sft", FP_A, w2, {})
    assert new.artifact_id == old.artifact_id and new.content_hash != old.content_hash
    store.verify(new)
    with pytest.raises(ArtifactError, match=f"{old.artifact_id} .* was republished with other content"):
        store.verify(old)


# --- discard and the replacement of broken artifacts -------------------------------------------


def test_discard_removes_the_artifact_so_it_is_rebuilt(store, tmp_path):
    w1, _ = _workdir(tmp_path, "w1", seed=1)
    w2, files2 = _workdir(tmp_path, "w2", seed=2)
    ref = store.publish("sft", FP_A, w1, {})
    other = store.publish("sft", FP_B, w1, {})
    store.discard("sft", ref.artifact_id)
    assert store.check("sft", FP_A) == ArtifactCheck("missing")
    assert _stage_entries(store, "sft") == [other.artifact_id]
    assert store.find("sft", FP_B) == other
    store.discard("sft", ref.artifact_id)  # nothing left: nothing to do
    new = store.publish("sft", FP_A, w2, {})
    assert _read(store, new, "model/weights.bin") == files2["model/weights.bin"]
    with pytest.raises(ValueError, match="not an artifact id of stage 'sft'"):
        store.discard("sft", "../rm")
    with pytest.raises(ValueError):
        store.discard("sft", "rm-" + FP_A[:16])


def test_discard_interrupted_after_the_manifest_leaves_nothing_published(tmp_path, monkeypatch):
    store = ArtifactStore(f"memory://posttrain-test-{uuid.uuid4().hex}", cache_dir=tmp_path / "cache")
    work, _ = _workdir(tmp_path, "work", seed=1)
    mem_cls = type(store.fs)
    try:
        ref = store.publish("sft", FP_A, work, {})

        # Test double: the connection drops when the files are being deleted (after the
        # manifest was): what remains must not look published.
        def drop(self, *a, **k):
            raise ConnectionError("connection reset")

        monkeypatch.setattr(mem_cls, "rm", drop)
        with pytest.raises(ConnectionError):
            store.discard("sft", ref.artifact_id)
        monkeypatch.undo()
        assert store.fs.exists(f"{store.base}/sft/{ref.artifact_id}/model/weights.bin")
        assert store.check("sft", FP_A) == ArtifactCheck("missing")
        assert store.find("sft", FP_A) is None and store.list("sft") == []
    finally:
        store.fs.rm(store.base, recursive=True)


def test_publish_replaces_a_broken_artifact_and_keeps_a_valid_one(store, tmp_path):
    w1, files1 = _workdir(tmp_path, "w1", seed=1)
    w2, files2 = _workdir(tmp_path, "w2", seed=2)
    first = store.publish("sft", FP_A, w1, {"metrics": {"run": 1}})
    assert store.publish("sft", FP_A, w2, {"metrics": {"run": 2}}) == first  # valid: kept
    adir = f"{store.base}/sft/{first.artifact_id}"
    _write(store, f"{adir}/{MANIFEST}", _read(store, first, MANIFEST)[:100])  # truncated manifest
    second = store.publish("sft", FP_A, w2, {"metrics": {"run": 2}})
    assert second.content_hash == content_hash(_expected_table(files2)) != first.content_hash
    assert store.find("sft", FP_A) == second
    assert store.manifest(second)["metrics"] == {"run": 2}
    store.verify(second)
    # A file of another size than its manifest says: replaced as well.
    _write(store, f"{adir}/report.md", b"short")
    assert store.find("sft", FP_A) is None
    third = store.publish("sft", FP_A, w1, {"metrics": {"run": 3}})
    assert store.find("sft", FP_A) == third and third.content_hash == first.content_hash
    assert _read(store, third, "report.md") == files1["report.md"]
    assert _stage_entries(store, "sft") == [first.artifact_id]


# --- temporary copies of killed publishes -----------------------------------------------------

_PUBLISHER = """
import sys
from pathlib import Path
from tasks.artifacts import ArtifactStore
root, stage, fp, work = sys.argv[1:5]
print(ArtifactStore(root).publish(stage, fp, Path(work), {"metrics": {"by": "subprocess"}}).model_dump_json())
"""


def _big_workdir(path: Path, mib: int) -> Path:
    path.mkdir()
    block = os.urandom(1 << 20)
    with open(path / "weights.bin", "wb") as f:
        for _ in range(mib):
            f.write(block)
    (path / "config.json").write_text('{"n": 1}')
    return path


def _start_publisher(root: str, stage: str, fp: str, work: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", _PUBLISHER, root, stage, fp, str(work)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_tmp(proc: subprocess.Popen, stage_dir: Path, aid: str, timeout: float = 120) -> Path | None:
    """The publisher's temporary copy as soon as it exists (polled every millisecond), or
    None if the publisher finished first (a loaded machine may not poll in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in stage_dir.glob(f".tmp-{aid}-*") if p.is_dir()] if stage_dir.is_dir() else []
        if found:
            return found[0]
        if proc.poll() is not None:
            assert proc.returncode == 0, proc.stderr.read()
            return None
        time.sleep(0.001)
    proc.kill()
    raise AssertionError("no temporary copy appeared")


def _interrupted_publisher(
    store: ArtifactStore, stage: str, fp: str, work: Path, sig: int
) -> tuple[subprocess.Popen, Path]:
    """A real publisher process sent ``sig`` (SIGKILL, or SIGSTOP to pause a live one) while its
    temporary copy exists. Tries again if the publish completed before the signal landed."""
    stage_dir, aid = Path(store.base) / stage, store.artifact_id(stage, fp)
    for _ in range(5):
        proc = _start_publisher(store.root, stage, fp, work)
        tmp = _wait_for_tmp(proc, stage_dir, aid)
        if tmp is not None:
            os.kill(proc.pid, sig)
            if sig == signal.SIGKILL:
                interrupted = proc.wait(60) == -signal.SIGKILL
            else:
                time.sleep(0.05)
                interrupted = proc.poll() is None
            if interrupted and tmp.is_dir():
                return proc, tmp
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        proc.communicate(timeout=120)
        store.discard(stage, aid)  # it won the race: publish it again
    raise AssertionError(f"could not interrupt a publish of {aid} in five tries")


def test_killed_local_publish_leaves_a_tmp_that_clean_stale_tmp_removes(tmp_path):
    root = tmp_path / "artifacts"
    stage_dir = root / "sft"
    store = ArtifactStore(str(root))
    live_work = _big_workdir(tmp_path / "live", 128)
    killed_work = _big_workdir(tmp_path / "killed", 128)
    live_aid, killed_aid = store.artifact_id("sft", FP_B), store.artifact_id("sft", FP_A)

    # A live publisher, paused (SIGSTOP) while its temporary copy exists: it holds its lock.
    live, live_tmp = _interrupted_publisher(store, "sft", FP_B, live_work, signal.SIGSTOP)
    try:
        # A publisher SIGKILLed mid-publish (its own clean-up at start kept the live copy).
        killed, killed_tmp = _interrupted_publisher(store, "sft", FP_A, killed_work, signal.SIGKILL)
        assert killed.returncode == -signal.SIGKILL
        killed.stdout.close()
        killed.stderr.close()

        assert live_tmp.is_dir() and killed_tmp.is_dir()
        assert killed_tmp.with_name(killed_tmp.name + ".lock").is_file()  # nobody holds it now
        assert store.find("sft", FP_A) is None and store.find("sft", FP_B) is None
        assert store.check("sft", FP_A) == ArtifactCheck("missing")
        assert store.list("sft") == []

        assert store.clean_stale_tmp("sft") == [str(killed_tmp)]
        assert not killed_tmp.exists() and not killed_tmp.with_name(killed_tmp.name + ".lock").exists()
        assert live_tmp.is_dir() and live_tmp.with_name(live_tmp.name + ".lock").is_file()
        assert store.clean_stale_tmp("sft") == []
    finally:
        os.kill(live.pid, signal.SIGCONT)
    out, err = live.communicate(timeout=120)
    assert live.returncode == 0, err
    ref = ArtifactRef.model_validate_json(out)
    assert store.find("sft", FP_B) == ref
    store.verify(ref)
    assert sorted(p.name for p in stage_dir.iterdir()) == [live_aid]  # no temporary, no lock left

    # The killed fingerprint publishes normally afterwards.
    ref_a = store.publish("sft", FP_A, killed_work, {})
    assert store.find("sft", FP_A) == ref_a
    assert sorted(p.name for p in stage_dir.iterdir()) == sorted([live_aid, killed_aid])


def test_publish_removes_stale_tmp_of_killed_publishes_first(tmp_path):
    root = tmp_path / "artifacts"
    store = ArtifactStore(str(root))
    proc, tmp = _interrupted_publisher(store, "rm", FP_A, _big_workdir(tmp_path / "killed", 64), signal.SIGKILL)
    proc.stdout.close()
    proc.stderr.close()
    assert tmp.exists()
    work, _ = _workdir(tmp_path, "work", seed=1)
    ref = store.publish("rm", FP_B, work, {})
    assert sorted(p.name for p in (root / "rm").iterdir()) == [ref.artifact_id]


def test_object_store_tmp_is_removed_by_age(tmp_path):
    """memory:// has no locks, as object stores: a temporary copy is stale by the age of its
    newest object (the same on a real S3 server: test_s3_store.py)."""
    root = f"memory://posttrain-test-{uuid.uuid4().hex}"
    work, _ = _workdir(tmp_path, "work", seed=1)
    keeper = ArtifactStore(root)
    assert keeper.stale_tmp_age_s == 3600
    try:
        leftover = f"{keeper.base}/sft/.tmp-{keeper.artifact_id('sft', FP_A)}-deadbeef"
        keeper.fs.put(str(work), leftover, recursive=True)
        assert keeper.clean_stale_tmp("sft") == []
        assert keeper.fs.exists(leftover) and keeper.find("sft", FP_A) is None and keeper.list("sft") == []
        time.sleep(0.3)
        assert ArtifactStore(root, stale_tmp_age_s=10).clean_stale_tmp("sft") == []
        assert ArtifactStore(root, stale_tmp_age_s=0.2).clean_stale_tmp("sft") == [f"memory://{leftover}"]
        assert not keeper.fs.exists(leftover)
    finally:
        keeper.fs.rm(keeper.base, recursive=True)


# --- config ------------------------------------------------------------------------------------


def test_config_refuses_a_memory_artifact_root(tmp_path):
    from config import ConfigError, load_config

    raw = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    for root in ("memory://pt/artifacts", "MEMORY://pt", "simplecache::memory://pt"):
        raw["run"]["artifact_root"] = root
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError) as info:
            load_config(tmp_path / "c.yaml")
        assert "run.artifact_root: memory:// keeps artifacts in this process's memory only" in str(info.value)
    for root in ("s3://bucket/artifacts", str(tmp_path / "memory"), "file:///tmp/memory"):
        raw["run"]["artifact_root"] = root
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
        assert load_config(tmp_path / "c.yaml").run.artifact_root == root
