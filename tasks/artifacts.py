"""The artifact store: versioned, content-addressed stage outputs on an fsspec URL.

Layout::

    <root>/<stage>/<artifact_id>/manifest.json   # written last; its presence = published
    <root>/<stage>/<artifact_id>/...             # the stage's files

``artifact_id`` is ``<stage>-<fingerprint[:16]>``, so the same inputs + config + code always
map to the same artifact (a cache hit), and every different fingerprint is a new version.
Publishing uploads into a temporary sibling, verifies every file's sha256 against the
manifest, then renames it into place: a reader never sees a partial artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec
from pydantic import BaseModel, ConfigDict

MANIFEST = "manifest.json"


class ArtifactRef(BaseModel):
    """A reference to a published artifact (what Prefect tasks pass between each other)."""

    model_config = ConfigDict(frozen=True)

    stage: str
    artifact_id: str
    fingerprint: str
    uri: str


class ArtifactError(RuntimeError):
    """A missing, partial or corrupt artifact (the message names the artifact and file)."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _file_table(directory: Path) -> list[dict[str, Any]]:
    files = []
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        # Only the top-level manifest is ours; a stage's own nested manifest.json is data.
        if p.is_file() and rel != MANIFEST:
            files.append({"path": rel, "size": p.stat().st_size, "sha256": sha256_file(p)})
    return files


def _check_files(fs: Any, url: str, manifest: dict[str, Any], action: str) -> None:
    """Raise ArtifactError naming the first file under ``url`` that is missing or whose
    sha256 differs from ``manifest``; ``action`` says what was being done (for the message)."""
    for entry in manifest["files"]:
        h = hashlib.sha256()
        try:
            with fs.open(f"{url}/{entry['path']}", "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
        except FileNotFoundError:
            raise ArtifactError(f"file {entry['path']} is missing while {action} {manifest['artifact_id']} ({url})") from None
        if h.hexdigest() != entry["sha256"]:
            raise ArtifactError(
                f"checksum mismatch for {entry['path']} while {action} {manifest['artifact_id']} ({url}): the "
                "artifact was modified after publishing; delete that directory and rerun to rebuild it"
            )


class ArtifactStore:
    """Publish and look up artifacts under ``root`` (a local path or any fsspec URL)."""

    def __init__(self, root: str, cache_dir: str | Path | None = None):
        self.root = root.rstrip("/")
        self.fs, self.base = fsspec.core.url_to_fs(self.root)
        self.is_local = self.fs.protocol in ("file", "local") or "file" in (self.fs.protocol or ())
        if self.is_local:
            self.base = os.path.abspath(self.base)
        self.cache_dir = Path(cache_dir or Path(tempfile.gettempdir()) / "posttrain-artifact-cache")

    # --- naming -----------------------------------------------------------------------
    @staticmethod
    def artifact_id(stage: str, fingerprint: str) -> str:
        return f"{stage}-{fingerprint[:16]}"

    def _dir(self, stage: str, artifact_id: str) -> str:
        return f"{self.base}/{stage}/{artifact_id}"

    def ref(self, stage: str, fingerprint: str) -> ArtifactRef:
        aid = self.artifact_id(stage, fingerprint)
        uri = self._dir(stage, aid) if self.is_local else f"{self.fs.unstrip_protocol(self._dir(stage, aid))}"
        return ArtifactRef(stage=stage, artifact_id=aid, fingerprint=fingerprint, uri=uri)

    # --- lookup -----------------------------------------------------------------------
    def find(self, stage: str, fingerprint: str) -> ArtifactRef | None:
        """The published artifact with this fingerprint, or None."""
        ref = self.ref(stage, fingerprint)
        return ref if self.fs.exists(f"{self._dir(stage, ref.artifact_id)}/{MANIFEST}") else None

    def manifest(self, ref: ArtifactRef) -> dict[str, Any]:
        path = f"{self._dir(ref.stage, ref.artifact_id)}/{MANIFEST}"
        try:
            with self.fs.open(path, "r") as f:
                return json.load(f)
        except FileNotFoundError:
            raise ArtifactError(f"artifact {ref.artifact_id} has no {MANIFEST} at {path} (not published)") from None

    def list(self, stage: str) -> list[dict[str, Any]]:
        """Manifests of every published version of ``stage``, oldest first."""
        stage_dir = f"{self.base}/{stage}"
        if not self.fs.exists(stage_dir):
            return []
        out = []
        for entry in self.fs.ls(stage_dir, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("."):
                continue
            mpath = f"{stage_dir}/{name}/{MANIFEST}"
            if self.fs.exists(mpath):
                with self.fs.open(mpath, "r") as f:
                    out.append(json.load(f))
        return sorted(out, key=lambda m: (m["created_at"], m["artifact_id"]))

    def latest(self, stage: str) -> dict[str, Any] | None:
        versions = self.list(stage)
        return versions[-1] if versions else None

    def local_path(self, ref: ArtifactRef) -> Path:
        """A local directory holding the artifact's files (downloaded once for remote stores).

        A remote artifact is cached under ``cache_dir/<hash of root>/<stage>/<artifact_id>``,
        checked against its manifest after download, and downloaded again when the store's
        manifest no longer equals the cached one (the artifact was deleted and republished).

        Raises:
            ArtifactError: the artifact is not published, or a downloaded file is corrupt.
        """
        remote = self._dir(ref.stage, ref.artifact_id)
        if self.is_local:
            path = Path(remote)
            if not (path / MANIFEST).is_file():
                raise ArtifactError(f"artifact {ref.artifact_id} is not published under {self.root}")
            return path
        try:
            with self.fs.open(f"{remote}/{MANIFEST}", "rb") as f:
                manifest_bytes = f.read()
        except FileNotFoundError:
            raise ArtifactError(f"artifact {ref.artifact_id} is not published under {self.root}") from None
        # Keyed by root too: two stores may hold different bytes under the same artifact id.
        root_key = hashlib.sha256(self.root.encode()).hexdigest()[:16]
        target = self.cache_dir / root_key / ref.stage / ref.artifact_id
        if (target / MANIFEST).is_file() and (target / MANIFEST).read_bytes() == manifest_bytes:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
        try:
            self.fs.get(remote, str(tmp), recursive=True)
            _check_files(fsspec.filesystem("file"), str(tmp), json.loads(manifest_bytes), "downloading")
            if target.exists():  # stale copy of an earlier publication
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if (target / MANIFEST).is_file() and (target / MANIFEST).read_bytes() == manifest_bytes:
                return target  # a concurrent reader finished the same download first
            raise
        return target

    # --- publish ----------------------------------------------------------------------
    def publish(self, stage: str, fingerprint: str, workdir: Path, manifest_fields: dict[str, Any]) -> ArtifactRef:
        """Atomically publish the files of ``workdir`` as the artifact of ``fingerprint``.

        ``manifest_fields`` adds e.g. inputs, config, code_version and metrics to the
        manifest. Returns the ref; if another process published the same fingerprint
        first, that artifact is kept (same inputs, same result) and ours is discarded.

        Raises:
            ArtifactError: a file's checksum differs after upload.
        """
        ref = self.ref(stage, fingerprint)
        manifest = {
            "stage": stage,
            "artifact_id": ref.artifact_id,
            "fingerprint": fingerprint,
            # Microseconds: list()/latest() order by this, and publishes can be < 1 ms apart.
            "created_at": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
            **manifest_fields,
            "files": _file_table(workdir),
        }
        (workdir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        final = self._dir(stage, ref.artifact_id)
        tmp = f"{self.base}/{stage}/.tmp-{ref.artifact_id}-{uuid.uuid4().hex[:8]}"
        try:
            if self.is_local:
                Path(tmp).parent.mkdir(parents=True, exist_ok=True)
                shutil.copytree(workdir, tmp)
            else:
                self.fs.put(str(workdir), tmp, recursive=True)
            self._verify(tmp, manifest)
            if self.fs.exists(f"{final}/{MANIFEST}"):
                self.fs.rm(tmp, recursive=True)
                return ref
            if self.is_local:
                if os.path.exists(final):  # a partial leftover without manifest: never published
                    shutil.rmtree(final)
                try:
                    os.rename(tmp, final)
                except OSError:
                    if not self.fs.exists(f"{final}/{MANIFEST}"):
                        raise
                    shutil.rmtree(tmp)  # another process published this fingerprint meanwhile
            else:
                self._move_remote(tmp, final, manifest)
        except BaseException:
            # A failed publish leaves nothing behind (a killed one leaves a hidden .tmp-*
            # directory, which list() and find() never see).
            if self.fs.exists(tmp):
                self.fs.rm(tmp, recursive=True)
            raise
        return ref

    def _move_remote(self, tmp: str, final: str, manifest: dict[str, Any]) -> None:
        # Object stores cannot rename a directory: the move is a copy per file. The
        # manifest goes last, so until the whole artifact is in place find() sees nothing.
        if self.fs.exists(final):  # a partial leftover of a crashed move: never published
            self.fs.rm(final, recursive=True)
        for entry in manifest["files"]:
            self.fs.mv(f"{tmp}/{entry['path']}", f"{final}/{entry['path']}")
        self.fs.mv(f"{tmp}/{MANIFEST}", f"{final}/{MANIFEST}")
        if self.fs.exists(tmp):
            self.fs.rm(tmp, recursive=True)

    def _verify(self, url: str, manifest: dict[str, Any]) -> None:
        _check_files(self.fs, url, manifest, "publishing")

    def verify(self, ref: ArtifactRef) -> None:
        """Re-check every file of a published artifact against its manifest.

        Raises:
            ArtifactError: the artifact is not published, or a file is missing or its sha256
                differs (the message names the file).
        """
        _check_files(self.fs, self._dir(ref.stage, ref.artifact_id), self.manifest(ref), "verifying")
