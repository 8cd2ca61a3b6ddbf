"""Helpers for the end-to-end tests: a tiny pipeline config, running the real CLI, reading
Prefect's task-run states and W&B's offline run files."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def tiny_config(workdir: Path, config: str = "quickstart.yaml", **overrides) -> dict:
    """The quickstart config (``configs/<config>``) shrunk for tests (same sections, fewer examples and steps)."""
    cfg = yaml.safe_load((REPO / "configs" / config).read_text())
    cfg["run"].update(artifact_root=str(workdir / "artifacts"), checkpoint_root=str(workdir / "checkpoints"))
    cfg["wandb"]["dir"] = str(workdir / "wandb")
    cfg["prepare"].update(output_dir=str(workdir / "inputs"), num_sft=256, num_preference=96, num_rl=256, num_eval=48)
    for name in ("sft", "preference", "rl_train", "rl_eval"):
        cfg["data"][name]["path"] = str(workdir / "inputs" / Path(cfg["data"][name]["path"]).name)
    cfg["model"]["source"] = str(workdir / "inputs" / "base_model")
    cfg["sft"].update(steps=6, checkpoint_every=3, global_batch_size=32, micro_batch_size=32)
    cfg["rm"].update(steps=4)
    cfg["rl"].update(steps=3, prompts_per_step=8, n_samples=4, checkpoint_every=1, micro_batch_size=32)
    cfg["rl"]["optim"]["warmup_steps"] = 3  # the quickstart's 10 would outlast the run (refused by the schema)
    cfg["evaluate"]["num_prompts"] = 24
    for dotted, value in overrides.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def env_for(workdir: Path) -> dict:
    env = dict(os.environ)
    env.update(
        PATH=f"{BIN}:{env.get('PATH', '')}",
        WANDB_MODE="offline",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        PYTHONPATH=str(REPO),
    )
    # A wandb-core started by this test process must not serve the commands' runs: they would
    # outlive a killed command, as they never do for a user.
    env.pop("WANDB_SERVICE", None)
    return env


_MIGRATED_DB: list[Path] = []  # this process's migrated template database, once made


def migrated_prefect_home(home: Path) -> Path:
    """Make ``home`` (created if missing) a PREFECT_HOME whose SQLite database already has
    Prefect's schema: a copy of a database migrated once per test process by ``prefect server
    database upgrade -y``. A ``prefect server start`` on a fresh home first runs every
    migration (23 s to healthy here under load, 12 s with the schema in place). Returns ``home``.

    Raises:
        AssertionError: the upgrade command failed (with its output).
    """
    if not _MIGRATED_DB:
        template = Path(tempfile.mkdtemp(prefix="prefect-migrated-"))
        atexit.register(shutil.rmtree, template, True)
        env = {
            **os.environ,
            "PREFECT_HOME": str(template),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
        }
        env.pop("PREFECT_API_URL", None)
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
        env.pop("PREFECT_SERVER_DATABASE_CONNECTION_URL", None)
        proc = subprocess.run(
            [str(BIN / "prefect"), "server", "database", "upgrade", "-y"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0 and (template / "prefect.db").is_file(), (
            f"prefect server database upgrade exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
        _MIGRATED_DB.append(template / "prefect.db")
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_MIGRATED_DB[0], home / "prefect.db")
    return home


def posttrain(args: list[str], cwd: Path, env: dict, timeout: float = 1500) -> subprocess.CompletedProcess:
    """Run the real ``posttrain`` console script; raise with its output if it fails."""
    proc = subprocess.run(
        [str(BIN / "posttrain"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"posttrain {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def read_summary(cwd: Path, run_name: str) -> dict:
    return json.loads((cwd / "outputs" / run_name / "summary.json").read_text())


def wandb_records(run_file: Path):
    """Parse a W&B ``.wandb`` transaction log (LevelDB log format: 32 KiB blocks of
    crc32/length/type-framed chunks) into ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B transaction log"
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - (pos % block)
        if left < 7:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if length == 0 and kind == 0:
            continue
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"{run_file}: bad record checksum at {pos}"
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            records.append(rec)
            pending = b""
    return records


def _item_key(item) -> str:
    return item.key or ".".join(item.nested_key)


def offline_run(run_file: Path) -> dict:
    """One W&B transaction log as a dict: ``id``, ``name``, ``group``, ``job_type``, ``tags``,
    ``config`` (flat: key -> value), ``history`` (rows as dicts with ``_step``, in file
    order), ``summary`` (key -> last value, without ``_wandb``), ``exit_code`` (None if the
    process died before finishing the run), ``superseded`` (a ``.wandb.synced`` marker lies
    beside it: ``wandb sync`` skips it), ``file`` and ``dir``."""
    run, config, summary, history, exit_code = None, {}, {}, [], None
    for rec in wandb_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
            for item in rec.run.config.update:
                config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            history.append({_item_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                summary[_item_key(item)] = json.loads(item.value_json)
        elif kind == "exit":
            exit_code = rec.exit.exit_code
    assert run is not None, f"{run_file} has no run record"
    config.pop("_wandb", None)
    summary = {k: v for k, v in summary.items() if not k.startswith("_wandb")}
    return {
        "id": run.run_id,
        "name": run.display_name,
        "group": run.run_group,
        "job_type": run.job_type,
        "tags": list(run.tags),
        "config": config,
        "history": history,
        "summary": summary,
        "exit_code": exit_code,
        "superseded": run_file.with_suffix(".wandb.synced").exists(),
        "file": run_file,
        "dir": run_file.parent,
    }


def offline_runs(wandb_dir: Path) -> list[dict]:
    """Every offline W&B run under ``wandb_dir`` (the config's ``wandb.dir``; wandb writes into
    its own ``wandb/`` folder there: ``<wandb_dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb``),
    oldest first, each as :func:`offline_run`."""
    files = sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"), key=lambda f: f.parent.name)
    return [offline_run(f) for f in files]
