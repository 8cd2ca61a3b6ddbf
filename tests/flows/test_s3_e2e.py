"""End to end on an object store: the real CLI runs the tiny quickstart with
``run.artifact_root: s3://<bucket>/artifacts`` against a moto S3 server on 127.0.0.1
(started and stopped here; the CLI finds it through the standard AWS variables), then
reruns it to check caching. Objects are listed with boto3, independently of the store.
"""

from __future__ import annotations

import json
import logging
import os
import uuid

import boto3
import pytest
from e2e_support import env_for, posttrain, read_summary, tiny_config, write_config

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out (clusters, engines, servers or pipelines)

STAGES = ["validate", "convert", "sft", "rm", "rl", "evaluate", "export"]


def test_summary_prints_the_export_url_as_given(capsys):
    """The exported model's location is printed as the URI it is: ``Path()`` once printed
    ``s3:/bucket/...`` and ``memory:/pt/...``."""
    from flows.cli import _print_summary

    for uri in (
        "s3://bucket/a/export/export-0123456789abcdef",
        "/abs/artifacts/export/export-0123456789abcdef",
        "gs://b/x/export/export-0123456789abcdef/",
    ):
        _print_summary(
            {"stages": {"export": {"state": "Completed", "wall_s": 1.0, "artifact_id": "export-0123", "uri": uri}}}
        )
        out = capsys.readouterr().out
        assert f"Exported model (HF SafeTensors): {uri.rstrip('/')}/hf_model\n" in out


@pytest.fixture(scope="module")
def s3_project(tmp_path_factory):
    """A moto S3 server with one bucket, and a working directory with the tiny config whose
    artifact root is in that bucket, after one full pipeline run."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        aws = {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        client = boto3.client(
            "s3",
            endpoint_url=aws["AWS_ENDPOINT_URL"],
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        bucket = f"posttrain-e2e-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        work = tmp_path_factory.mktemp("s3-pipeline")
        cfg = tiny_config(work, **{"run.artifact_root": f"s3://{bucket}/artifacts"})
        config = write_config(work / "pipeline.yaml", cfg)
        env = env_for(work)
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            env.pop(key, None)
        env.update(aws)
        proc = posttrain(["run", str(config)], cwd=work, env=env)
        yield {
            "work": work,
            "config": config,
            "env": env,
            "bucket": bucket,
            "client": client,
            "first": read_summary(work, "quickstart"),
            "first_stdout": proc.stdout,
        }
    finally:
        server.stop()


def _objects(project) -> dict[str, int]:
    """Key -> size of every object in the bucket."""
    pages = project["client"].get_paginator("list_objects_v2").paginate(Bucket=project["bucket"])
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def _states(summary: dict) -> dict[str, str]:
    return {name: s.get("state") for name, s in summary["stages"].items() if name in STAGES}


@pytest.mark.slow
def test_every_stage_publishes_into_the_bucket(s3_project):
    summary, bucket = s3_project["first"], s3_project["bucket"]
    assert _states(summary) == {s: "Completed" for s in STAGES}
    objects = _objects(s3_project)
    assert not [k for k in objects if "/.tmp-" in k]  # no temporary copy left behind
    for name in STAGES:
        aid = summary["stages"][name]["artifact_id"]
        assert summary["stages"][name]["uri"] == f"s3://{bucket}/artifacts/{name}/{aid}"
        manifest = json.loads(
            s3_project["client"].get_object(Bucket=bucket, Key=f"artifacts/{name}/{aid}/manifest.json")["Body"].read()
        )
        assert manifest["stage"] == name and manifest["artifact_id"] == aid and manifest["files"]
        for f in manifest["files"]:
            assert objects[f"artifacts/{name}/{aid}/{f['path']}"] == f["size"]
        listed = {k for k in objects if k.startswith(f"artifacts/{name}/")}
        assert listed == {f"artifacts/{name}/{aid}/{f['path']}" for f in manifest["files"]} | {
            f"artifacts/{name}/{aid}/manifest.json"
        }
    # Nothing went to a local directory that a collapsed URL would name (s3:/bucket/...).
    work = s3_project["work"]
    assert not (work / "s3:").exists() and not (work / "artifacts").exists()


@pytest.mark.slow
def test_export_uri_is_printed_and_recorded_as_an_s3_url(s3_project):
    summary, bucket, work = s3_project["first"], s3_project["bucket"], s3_project["work"]
    aid = summary["stages"]["export"]["artifact_id"]
    uri = f"s3://{bucket}/artifacts/export/{aid}"
    assert f"Exported model (HF SafeTensors): {uri}/hf_model" in s3_project["first_stdout"]
    pointer = json.loads((work / "outputs" / "quickstart" / "export.json").read_text())
    assert pointer["uri"] == uri and pointer["artifact_id"] == aid
    assert (
        pointer["content_hash"]
        == json.loads(
            s3_project["client"].get_object(Bucket=bucket, Key=f"artifacts/export/{aid}/manifest.json")["Body"].read()
        )["content_hash"]
    )
    assert json.loads((work / "outputs" / "quickstart" / "summary.json").read_text())["stages"]["export"]["uri"] == uri
    hf_keys = [k for k in _objects(s3_project) if k.startswith(f"artifacts/export/{aid}/hf_model/")]
    assert f"artifacts/export/{aid}/hf_model/config.json" in hf_keys
    assert any(k.endswith(".safetensors") for k in hf_keys)


@pytest.mark.slow
def test_second_run_on_s3_is_all_cached(s3_project):
    before = _objects(s3_project)
    posttrain(["run", str(s3_project["config"])], cwd=s3_project["work"], env=s3_project["env"])
    summary = read_summary(s3_project["work"], "quickstart")
    assert _states(summary) == {s: "Cached" for s in STAGES}
    assert _objects(s3_project) == before  # nothing new published
    assert {s: summary["stages"][s]["artifact_id"] for s in STAGES} == {
        s: s3_project["first"]["stages"][s]["artifact_id"] for s in STAGES
    }
