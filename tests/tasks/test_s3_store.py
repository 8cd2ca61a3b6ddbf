"""ArtifactStore on a real S3 API: a moto server on 127.0.0.1 (started and stopped here),
reached through s3fs exactly as a bucket on AWS would be (endpoint and dummy credentials
from the standard AWS environment variables). Objects are inspected and damaged with
boto3, independently of the store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import s3fs

from tasks.artifacts import (
    MANIFEST,
    ArtifactCheck,
    ArtifactError,
    ArtifactRef,
    ArtifactStore,
    CorruptArtifact,
    content_hash,
)

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

REPO = Path(__file__).resolve().parents[2]
FP_A = hashlib.sha256(b"s3 fingerprint a").hexdigest()
FP_B = hashlib.sha256(b"s3 fingerprint b").hexdigest()


@dataclass
class S3:
    endpoint: str
    bucket: str
    client: object

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free loopback port, the AWS variables pointing at it, one bucket."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    mp = pytest.MonkeyPatch()
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        mp.delenv(key, raising=False)
    for key, value in {
        "AWS_ENDPOINT_URL": endpoint,  # botocore (and so s3fs and boto3) honour it
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }.items():
        mp.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance made for another endpoint must not be reused
    client = boto3.client("s3")
    bucket = f"posttrain-test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    try:
        yield S3(endpoint, bucket, client)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        mp.undo()
        server.stop()


@pytest.fixture
def root(s3) -> str:
    """A fresh artifact root (a prefix of its own) in the test bucket."""
    return f"s3://{s3.bucket}/run-{uuid.uuid4().hex[:8]}/artifacts"


def _prefix(root: str) -> str:
    return root.split("/", 3)[3]


def _workdir(path: Path, seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {
        "model/weights.bin": bytes(rng.randrange(256) for _ in range(4096)),
        "model/config.json": json.dumps({"hidden_size": 64, "seed": seed}).encode(),
        "model/manifest.json": b'{"owned_by": "the stage"}',
        "report.md": f"# report {seed}\n".encode(),
    }
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return files


def _table(files: dict[str, bytes]) -> list[dict]:
    return [{"path": r, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for r, d in sorted(files.items())]


def test_publish_find_list_and_download(s3, root, tmp_path):
    store = ArtifactStore(root, cache_dir=tmp_path / "cache")
    assert not store.is_local and store.fs.protocol[0] == "s3"
    work = tmp_path / "work"
    files = _workdir(work, seed=1)
    assert store.find("sft", FP_A) is None and store.list("sft") == []
    ref = store.publish("sft", FP_A, work, {"metrics": {"loss": 0.5}})
    aid = store.artifact_id("sft", FP_A)
    assert ref.uri == f"{root}/sft/{aid}"  # s3:// kept, no collapsed //
    assert ref.content_hash == content_hash(_table(files))
    assert store.find("sft", FP_A) == ref
    assert ArtifactStore(root).find("sft", FP_A) == ref  # another store instance sees it
    prefix = _prefix(root)
    assert s3.keys(prefix) == sorted(
        [f"{prefix}/sft/{aid}/{rel}" for rel in files] + [f"{prefix}/sft/{aid}/{MANIFEST}"]
    )
    manifest = json.loads(s3.get(f"{prefix}/sft/{aid}/{MANIFEST}"))
    assert manifest["files"] == _table(files) and manifest["content_hash"] == ref.content_hash
    assert manifest["metrics"] == {"loss": 0.5}
    assert [m["artifact_id"] for m in store.list("sft")] == [aid]
    assert store.manifest(ref) == manifest
    store.verify(ref)

    local = store.local_path(ref)
    assert local.is_relative_to(tmp_path / "cache")
    got = {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    assert got.pop(MANIFEST) == s3.get(f"{prefix}/sft/{aid}/{MANIFEST}")
    assert got == files
    assert store.local_path(ref) == local

    # The same fingerprint again: the published one is kept.
    files2 = _workdir(tmp_path / "work2", seed=2)
    assert store.publish("sft", FP_A, tmp_path / "work2", {}) == ref
    assert s3.get(f"{prefix}/sft/{aid}/model/weights.bin") == files["model/weights.bin"] != files2["model/weights.bin"]


def test_corrupt_object_is_caught_on_download_and_verify(s3, root, tmp_path):
    store = ArtifactStore(root, cache_dir=tmp_path / "cache")
    files = _workdir(tmp_path / "work", seed=3)
    ref = store.publish("convert", FP_A, tmp_path / "work", {})
    key = f"{_prefix(root)}/convert/{ref.artifact_id}/model/weights.bin"
    data = bytearray(files["model/weights.bin"])
    data[100] ^= 0x01  # same size: only a checksum sees it
    s3.put(key, bytes(data))
    assert store.find("convert", FP_A) == ref
    assert store.check("convert", FP_A, verify=True) == ArtifactCheck(
        "broken", None, "checksum mismatch for model/weights.bin", store.manifest(ref)
    )
    with pytest.raises(
        CorruptArtifact, match=r"checksum mismatch for model/weights\.bin while downloading convert-"
    ) as info:
        store.local_path(ref)
    assert (info.value.stage, info.value.artifact_id, info.value.file) == (
        "convert",
        ref.artifact_id,
        "model/weights.bin",
    )
    assert list((tmp_path / "cache").rglob("weights.bin")) == []  # nothing half-downloaded is kept
    with pytest.raises(
        CorruptArtifact,
        match=rf"checksum mismatch for model/weights\.bin while verifying {ref.artifact_id} "
        rf"\({s3.bucket}/",
    ):
        store.verify(ref)


def test_check_states_and_repair_on_s3(s3, root, tmp_path, caplog):
    store = ArtifactStore(root, cache_dir=tmp_path / "cache")
    files = _workdir(tmp_path / "work", seed=4)
    other = _workdir(tmp_path / "other", seed=5)
    assert store.check("rm", FP_A) == ArtifactCheck("missing")
    ref = store.publish("rm", FP_A, tmp_path / "work", {})
    newer = store.publish("rm", FP_B, tmp_path / "other", {})
    assert store.check("rm", FP_A).state == "published"
    prefix = f"{_prefix(root)}/rm/{ref.artifact_id}"

    s3.put(f"{prefix}/report.md", b"# short")
    assert store.check("rm", FP_A).problem == f"report.md: 7 bytes, manifest says {len(files['report.md'])}"
    s3.client.delete_object(Bucket=s3.bucket, Key=f"{prefix}/report.md")
    assert store.check("rm", FP_A).problem == "report.md is missing"
    assert store.find("rm", FP_A) is None

    good = s3.get(f"{prefix}/{MANIFEST}")
    s3.put(f"{prefix}/{MANIFEST}", b'{"stage": "rm", "files": [{"path"')
    assert store.check("rm", FP_A) == ArtifactCheck(
        "broken", None, "manifest.json is not valid JSON (line 1 column 34)", None
    )
    assert store.find("rm", FP_A) is None
    with pytest.raises(ArtifactError) as info:
        store.manifest(ref)
    assert (
        str(info.value)
        == f"s3://{s3.bucket}/{prefix}/{MANIFEST} is not valid JSON (line 1 column 34) (artifact {ref.artifact_id})"
    )
    with caplog.at_level(logging.WARNING, logger="posttrain.artifacts"):
        assert [m["artifact_id"] for m in store.list("rm")] == [newer.artifact_id]
    assert any(
        f"s3://{s3.bucket}/{prefix}/{MANIFEST}" in r.getMessage()
        for r in caplog.records
        if r.name == "posttrain.artifacts"
    )
    assert store.latest("rm")["artifact_id"] == newer.artifact_id

    # publish replaces the broken artifact (stray objects of the old one go with it).
    replaced = store.publish("rm", FP_A, tmp_path / "other", {"metrics": {"rebuilt": True}})
    assert replaced.content_hash == content_hash(_table(other)) == newer.content_hash
    assert store.find("rm", FP_A) == replaced and store.manifest(replaced)["metrics"] == {"rebuilt": True}
    assert s3.keys(prefix) == sorted([f"{prefix}/{rel}" for rel in other] + [f"{prefix}/{MANIFEST}"])
    assert json.loads(good)["content_hash"] == ref.content_hash

    # discard: the manifest and every object go; nothing is found.
    store.discard("rm", replaced.artifact_id)
    assert s3.keys(prefix) == []
    assert store.check("rm", FP_A) == ArtifactCheck("missing")
    assert store.find("rm", FP_B) == newer


_PUBLISHER = """
import sys
from pathlib import Path
from tasks.artifacts import ArtifactStore
root, stage, fp, work = sys.argv[1:5]
print(ArtifactStore(root).publish(stage, fp, Path(work), {}).model_dump_json())
"""


def test_killed_publish_leaves_a_tmp_prefix_removed_by_age(s3, root, tmp_path):
    work = tmp_path / "work"
    block = os.urandom(1 << 20)
    for i in range(24):  # a multi-file artifact: 24 objects of 1 MiB
        (work / "shards").mkdir(parents=True, exist_ok=True)
        (work / "shards" / f"{i:02d}.bin").write_bytes(block)
    (work / "config.json").write_text('{"n": 24}')
    stage_prefix = f"{_prefix(root)}/rl/"
    tmp_prefix = f"{stage_prefix}.tmp-{ArtifactStore.artifact_id('rl', FP_A)}-"
    proc = subprocess.Popen(
        [sys.executable, "-c", _PUBLISHER, root, "rl", FP_A, str(work)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not s3.keys(tmp_prefix):
        assert proc.poll() is None, (
            f"publisher ended ({proc.returncode}) before its .tmp prefix was seen: {proc.stderr.read()}"
        )
        assert time.monotonic() < deadline, "no .tmp prefix appeared"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    proc.stdout.close()
    proc.stderr.close()

    # Uploads the killed process had already sent still land: wait until the prefix is still.
    left, settle = s3.keys(tmp_prefix), time.monotonic() + 30
    while time.monotonic() < settle:
        time.sleep(0.5)
        if (now := s3.keys(tmp_prefix)) == left:
            break
        left = now
    assert left and all(k.startswith(tmp_prefix) for k in s3.keys(stage_prefix))  # only the temporary copy
    store = ArtifactStore(root, cache_dir=tmp_path / "cache")
    assert store.find("rl", FP_A) is None
    assert store.check("rl", FP_A) == ArtifactCheck("missing")
    assert store.list("rl") == [] and store.latest("rl") is None
    assert store.clean_stale_tmp("rl") == []  # default age (an hour): it may be a live publish
    assert ArtifactStore(root, stale_tmp_age_s=60).clean_stale_tmp("rl") == []
    assert s3.keys(tmp_prefix) == left
    time.sleep(2.5)
    tmp_dir = left[0][: left[0].index("/", len(tmp_prefix))]  # <prefix>/rl/.tmp-<id>-<hex>
    assert ArtifactStore(root, stale_tmp_age_s=1).clean_stale_tmp("rl") == [f"s3://{s3.bucket}/{tmp_dir}"]
    assert s3.keys(stage_prefix) == []

    ref = store.publish("rl", FP_A, work, {})
    assert store.find("rl", FP_A) == ref and ref.uri.startswith(f"s3://{s3.bucket}/")
    assert [k for k in s3.keys(stage_prefix) if "/.tmp-" in k] == []
    assert len(s3.keys(stage_prefix)) == 26  # 24 shards, config.json, manifest.json


def test_ref_round_trips_as_json_with_its_url(s3, root, tmp_path):
    store = ArtifactStore(root)
    _workdir(tmp_path / "work", seed=6)
    ref = store.publish("export", FP_B, tmp_path / "work", {})
    back = ArtifactRef.model_validate_json(ref.model_dump_json())
    assert back == ref and back.uri.startswith(f"s3://{s3.bucket}/") and "s3:/" + s3.bucket not in back.uri
