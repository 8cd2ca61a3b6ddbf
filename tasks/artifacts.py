"""The artifact store: versioned, content-addressed stage outputs on an fsspec URL.

Layout::

    <root>/<stage>/<artifact_id>/manifest.json   # written last; its presence = published
    <root>/<stage>/<artifact_id>/...             # the stage's files
    <root>/<stage>/.tmp-<artifact_id>-<hex>/     # a publish in progress (or a killed one)
    <root>/<stage>/.tmp-<artifact_id>-<hex>.lock # local stores: held by the publishing process

``artifact_id`` is ``<stage>-<fingerprint[:16]>``, so the same inputs + config + code always
map to the same artifact (a cache hit), and every different fingerprint is a new version.
Publishing uploads into a temporary sibling, verifies every file's sha256 against the
manifest, then renames it into place: a reader never sees a partial artifact.

``root`` stays a URL throughout (``s3://bucket/a`` is never turned into a ``pathlib.Path``,
which would collapse ``//``): refs of remote stores carry ``s3://...`` URIs, refs of local
stores an absolute path.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Literal

import fsspec
from pydantic import BaseModel, ConfigDict

from data.checksums import sha256_file  # noqa: F401  (the project's one file hash; also imported from here)
from data.disk_full import naming_a_full_disk
from tasks.locks import open_locked, owned_dir, release, remove_if_unowned
from tasks.manifests import (
    MANIFEST,
    BadManifest,
    content_hash,
    file_table,
    hash_file,
    parse_manifest,
    table_problem,
)

TMP_PREFIX = ".tmp-"
log = logging.getLogger("posttrain.artifacts")


class ArtifactRef(BaseModel):
    """A reference to a published artifact (what Prefect tasks pass between each other).

    content_hash: :func:`content_hash` of the artifact's files table; what downstream
        fingerprints use (a byte-identical rebuild has the same one).
    uri: where the artifact lives: an absolute path for local stores, a URL with its
        protocol (``s3://bucket/...``) for every other store.
    """

    model_config = ConfigDict(frozen=True)

    stage: str
    artifact_id: str
    fingerprint: str
    uri: str
    content_hash: str


class ArtifactError(RuntimeError):
    """A missing, partial or corrupt artifact (the message names the artifact and file)."""


class CorruptArtifact(ArtifactError):
    """A file of a published artifact is missing or its sha256 differs from the manifest.

    Attributes:
        stage: the artifact's stage.
        artifact_id: the artifact's id (what :meth:`ArtifactStore.discard` takes).
        file: the file's path inside the artifact.
    """

    def __init__(self, message: str, stage: str, artifact_id: str, file: str | None = None):
        super().__init__(message)
        self.stage = stage
        self.artifact_id = artifact_id
        self.file = file

    def __reduce__(self):
        # Prefect pickles task exceptions; the default reduce would call __init__(message) only.
        return (type(self), (str(self), self.stage, self.artifact_id, self.file))


@dataclass(frozen=True)
class ArtifactCheck:
    """What the store holds for one fingerprint.

    state: "published" (complete and consistent with its manifest), "missing" (no
        manifest.json: never published, or a leftover without one) or "broken" (a
        manifest.json that is unreadable, or files that disagree with it).
    ref: the artifact's ref when published, else None.
    problem: when broken, which file and what is wrong with it; else None.
    manifest: the parsed manifest.json when it is readable JSON, else None.
    """

    state: Literal["published", "missing", "broken"]
    ref: ArtifactRef | None = None
    problem: str | None = None
    manifest: dict[str, Any] | None = None

    def published_ref(self) -> ArtifactRef:
        """``ref`` of a published artifact (RuntimeError for any other state)."""
        if self.state != "published" or self.ref is None:
            raise RuntimeError(f"artifact check: {self.state}, not published")
        return self.ref


def _check_files(fs: Any, url: str, manifest: dict[str, Any], action: str, stage: str, artifact_id: str) -> None:
    """Raise CorruptArtifact naming the first file under ``url`` that is missing or whose
    sha256 differs from ``manifest``; ``action`` says what was being done (for the message)."""
    for entry in manifest["files"]:
        try:
            digest = hash_file(fs, f"{url}/{entry['path']}")
        except FileNotFoundError:
            raise CorruptArtifact(
                f"file {entry['path']} is missing while {action} {artifact_id} ({url})",
                stage,
                artifact_id,
                entry["path"],
            ) from None
        if digest != entry["sha256"]:
            raise CorruptArtifact(
                f"checksum mismatch for {entry['path']} while {action} {artifact_id} ({url}): the artifact was "
                "modified after publishing (a pipeline run discards it and rebuilds its stage)",
                stage,
                artifact_id,
                entry["path"],
            )


def _timestamp(fs: Any, info: dict[str, Any]) -> float:
    """Modification time (Unix seconds) of one listed object."""
    for key in ("LastModified", "mtime", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return fs.modified(info["name"]).timestamp()


class ArtifactStore:
    """Publish and look up artifacts under ``root`` (a local path or any fsspec URL).

    stale_tmp_age_s: on stores without locks (object stores), a temporary publish copy
        whose newest object is older than this many seconds is taken for a killed publish
        and removed by :meth:`clean_stale_tmp`.
    """

    def __init__(self, root: str, cache_dir: str | Path | None = None, stale_tmp_age_s: float = 3600.0):
        self.root = root.rstrip("/") or root
        self.fs, self.base = fsspec.core.url_to_fs(self.root)
        self.is_local = self.fs.protocol in ("file", "local") or "file" in (self.fs.protocol or ())
        if self.is_local:
            self.base = os.path.abspath(self.base)
        else:
            # Another process may publish at any time: directory listings must not be served
            # from this process's cache (s3fs keeps them otherwise).
            self.fs, self.base = fsspec.core.url_to_fs(self.root, use_listings_cache=False)
        self.cache_dir = Path(cache_dir or Path(tempfile.gettempdir()) / "posttrain-artifact-cache")
        self.stale_tmp_age_s = stale_tmp_age_s

    # --- naming -----------------------------------------------------------------------
    @staticmethod
    def artifact_id(stage: str, fingerprint: str) -> str:
        """``<stage>-<fingerprint[:16]>``: the artifact's directory name under its stage."""
        return f"{stage}-{fingerprint[:16]}"

    def _dir(self, stage: str, artifact_id: str) -> str:
        return f"{self.base}/{stage}/{artifact_id}"

    def _uri(self, stage: str, artifact_id: str) -> str:
        return self._display(self._dir(stage, artifact_id))

    def _display(self, path: str) -> str:
        """``path`` (a path of this store's filesystem) as users should see it: with its protocol."""
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def _ref(self, stage: str, fingerprint: str, chash: str) -> ArtifactRef:
        aid = self.artifact_id(stage, fingerprint)
        return ArtifactRef(
            stage=stage, artifact_id=aid, fingerprint=fingerprint, uri=self._uri(stage, aid), content_hash=chash
        )

    def _read_manifest(self, path: str) -> dict[str, Any]:
        """Parsed manifest.json at ``path``. Raises FileNotFoundError or BadManifest."""
        with self.fs.open(path, "rb") as f:
            return parse_manifest(f.read())

    # --- lookup -----------------------------------------------------------------------
    def check(self, stage: str, fingerprint: str, verify: bool = False) -> ArtifactCheck:
        """What the store holds for ``fingerprint`` of ``stage``.

        Reads one listing of the artifact's directory (with sizes) and its manifest.json:
        every file the manifest lists must be there with the recorded size, and the
        manifest must be a readable files table of this fingerprint. ``verify`` also
        re-hashes every file (reads all of it: slow for large remote artifacts).

        Returns:
            An :class:`ArtifactCheck`: "published" with its ref, "missing" (no manifest.json)
            or "broken" with the problem, e.g. "manifest.json is not valid JSON (line 1
            column 40)", "model/x.distcp: 812 bytes, manifest says 1024", "model/x.distcp is
            missing" or "checksum mismatch for model/x.distcp".
        """
        aid = self.artifact_id(stage, fingerprint)
        directory = self._dir(stage, aid)
        prefix = self.fs._strip_protocol(directory).rstrip("/") + "/"
        try:
            listing = self.fs.find(directory, detail=True)
        except FileNotFoundError:
            listing = {}
        sizes = {name[len(prefix) :]: info.get("size") for name, info in listing.items() if name.startswith(prefix)}
        if MANIFEST not in sizes:
            return ArtifactCheck("missing")
        try:
            manifest = self._read_manifest(f"{directory}/{MANIFEST}")
        except FileNotFoundError:  # removed between the listing and the read
            return ArtifactCheck("missing")
        except BadManifest as exc:
            return ArtifactCheck("broken", problem=str(exc))

        def broken(problem: str) -> ArtifactCheck:
            return ArtifactCheck("broken", problem=problem, manifest=manifest)

        if (problem := table_problem(manifest)) is not None:
            return broken(problem)
        if manifest.get("fingerprint", fingerprint) != fingerprint:
            return broken(f"{MANIFEST} is of fingerprint {str(manifest['fingerprint'])[:16]}, not {fingerprint[:16]}")
        files = manifest["files"]
        chash = content_hash(files)
        if manifest.get("content_hash", chash) != chash:
            return broken(f"{MANIFEST}: its content_hash does not match its files table")
        for entry in files:
            size = sizes.get(entry["path"])
            if size is None:
                return broken(f"{entry['path']} is missing")
            if size != entry["size"]:
                return broken(f"{entry['path']}: {size} bytes, manifest says {entry['size']}")
        if verify:
            for entry in files:
                try:
                    digest = hash_file(self.fs, f"{directory}/{entry['path']}")
                except FileNotFoundError:
                    return broken(f"{entry['path']} is missing")
                if digest != entry["sha256"]:
                    return broken(f"checksum mismatch for {entry['path']}")
        return ArtifactCheck("published", ref=self._ref(stage, fingerprint, chash), manifest=manifest)

    def find(self, stage: str, fingerprint: str) -> ArtifactRef | None:
        """The published artifact with this fingerprint, or None when its manifest is
        missing or unreadable, or a listed file is missing or of another size than the
        manifest records (see :meth:`check`; no file is hashed)."""
        return self.check(stage, fingerprint).ref

    def manifest(self, ref: ArtifactRef) -> dict[str, Any]:
        """The parsed manifest.json of ``ref``.

        Raises:
            ArtifactError: there is no manifest.json (not published), or it is not a valid
                JSON object (the message names its full path).
        """
        path = f"{self._dir(ref.stage, ref.artifact_id)}/{MANIFEST}"
        try:
            return self._read_manifest(path)
        except FileNotFoundError:
            raise ArtifactError(f"artifact {ref.artifact_id} has no {MANIFEST} at {path} (not published)") from None
        except BadManifest as exc:
            raise ArtifactError(f"{self._display(path)} {exc.detail} (artifact {ref.artifact_id})") from None

    def list(self, stage: str) -> list[dict[str, Any]]:
        """Manifests of every published version of ``stage``, oldest first.

        A version whose manifest.json is unreadable (truncated, not JSON) is left out, with
        a warning on the ``posttrain.artifacts`` logger naming the file.
        """
        stage_dir = f"{self.base}/{stage}"
        try:
            entries = self.fs.ls(stage_dir, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("."):
                continue
            mpath = f"{stage_dir}/{name}/{MANIFEST}"
            try:
                out.append(self._read_manifest(mpath))
            except FileNotFoundError:
                continue  # a directory without manifest: never published
            except BadManifest as exc:
                log.warning("skipping version %s of %s: %s %s", name, stage, self._display(mpath), exc.detail)
        return sorted(out, key=lambda m: (str(m.get("created_at", "")), str(m.get("artifact_id", ""))))

    def latest(self, stage: str) -> dict[str, Any] | None:
        """The manifest of the most recently published version of ``stage``, or None."""
        versions = self.list(stage)
        return versions[-1] if versions else None

    def local_path(self, ref: ArtifactRef) -> Path:
        """A local directory holding the artifact's files (downloaded once for remote stores).

        A remote artifact is cached under ``cache_dir/<hash of root>/<stage>/<artifact_id>``,
        checked against its manifest after download, and downloaded again when the store's
        manifest no longer equals the cached one (the artifact was deleted and republished).

        Raises:
            ArtifactError: the artifact is not published, or its manifest is unreadable.
            CorruptArtifact: a downloaded file is missing or its sha256 differs.
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
        try:
            manifest = parse_manifest(manifest_bytes)
        except BadManifest as exc:
            raise ArtifactError(
                f"{self._display(remote)}/{MANIFEST} {exc.detail} (artifact {ref.artifact_id})"
            ) from None
        if (problem := table_problem(manifest)) is not None:
            raise ArtifactError(f"artifact {ref.artifact_id} ({self._display(remote)}): {problem}")
        # Keyed by root too: two stores may hold different bytes under the same artifact id.
        root_key = hashlib.sha256(self.root.encode()).hexdigest()[:16]
        target = self.cache_dir / root_key / ref.stage / ref.artifact_id
        if (target / MANIFEST).is_file() and (target / MANIFEST).read_bytes() == manifest_bytes:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
        try:
            self.fs.get(remote, str(tmp), recursive=True)
            _check_files(fsspec.filesystem("file"), str(tmp), manifest, "downloading", ref.stage, ref.artifact_id)
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
        manifest; the store adds stage, artifact_id, fingerprint, created_at, files and
        content_hash. Stale temporary copies of killed publishes are removed first
        (:meth:`clean_stale_tmp`). If a valid artifact of this fingerprint is already
        published (or another process publishes it first), that one is kept and its ref
        returned (same inputs, same result); a broken one (see :meth:`check`) is replaced.

        Raises:
            CorruptArtifact: a file's checksum differs after upload (nothing is published).
        """
        self.clean_stale_tmp(stage)
        current = self.check(stage, fingerprint)
        if current.state == "published":
            return current.published_ref()
        aid = self.artifact_id(stage, fingerprint)
        files = file_table(workdir)
        manifest = {
            "stage": stage,
            "artifact_id": aid,
            "fingerprint": fingerprint,
            # Microseconds: list()/latest() order by this, and publishes can be < 1 ms apart.
            "created_at": datetime.now(UTC).isoformat(timespec="microseconds"),
            **manifest_fields,
            "files": files,
            "content_hash": content_hash(files),
        }
        (workdir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        final = self._dir(stage, aid)
        tmp = f"{self.base}/{stage}/{TMP_PREFIX}{aid}-{uuid.uuid4().hex[:8]}"
        lock: IO[str] | None = None
        try:
            size = sum(f["size"] for f in files)
            with naming_a_full_disk(
                self._display(tmp),
                f"publishing {aid}",
                size,
                "free space there or set "
                "run.artifact_root elsewhere; nothing was published and the stage's checkpoint is kept",
            ):
                if self.is_local:
                    os.makedirs(os.path.dirname(tmp), exist_ok=True)
                    lock = owned_dir(Path(tmp))  # locked before it exists: never seen unowned
                    shutil.copytree(workdir, tmp, dirs_exist_ok=True)
                else:
                    self.fs.put(str(workdir), tmp, recursive=True)
            _check_files(self.fs, tmp, manifest, "publishing", stage, aid)
            current = self.check(stage, fingerprint)
            if current.state == "published":  # another process published it meanwhile
                self.fs.rm(tmp, recursive=True)
                return current.published_ref()
            if current.state == "broken" or self.fs.exists(final):
                # A broken artifact, or a partial leftover without manifest: never valid.
                self.discard(stage, aid)
            if self.is_local:
                try:
                    os.rename(tmp, final)
                except OSError:
                    winner = self.check(stage, fingerprint)
                    if winner.state != "published":
                        raise
                    shutil.rmtree(tmp)  # another process published this fingerprint meanwhile
                    return winner.published_ref()
            else:
                self._move_remote(tmp, final, manifest)
        except BaseException:
            # A failed publish leaves nothing behind; a killed one leaves a hidden .tmp-*
            # copy that list() and find() never see and clean_stale_tmp() removes.
            if self.fs.exists(tmp):
                self.fs.rm(tmp, recursive=True)
            raise
        finally:
            if lock is not None:
                release(lock)
        return self._ref(stage, fingerprint, manifest["content_hash"])

    def _move_remote(self, tmp: str, final: str, manifest: dict[str, Any]) -> None:
        # Object stores cannot rename a directory: the move is a copy per file. The
        # manifest goes last, so until the whole artifact is in place find() sees nothing.
        for entry in manifest["files"]:
            self.fs.mv(f"{tmp}/{entry['path']}", f"{final}/{entry['path']}")
        self.fs.mv(f"{tmp}/{MANIFEST}", f"{final}/{MANIFEST}")
        if self.fs.exists(tmp):
            self.fs.rm(tmp, recursive=True)

    def verify(self, ref: ArtifactRef) -> None:
        """Re-check every file of a published artifact against its manifest.

        Raises:
            ArtifactError: the artifact is not published, its manifest is unreadable, or it
                was republished with other content than ``ref`` names (another content hash).
            CorruptArtifact: a file is missing or its sha256 differs (the message names the
                file and the artifact).
        """
        manifest = self.manifest(ref)
        directory = self._dir(ref.stage, ref.artifact_id)
        if (problem := table_problem(manifest)) is not None:
            raise ArtifactError(f"artifact {ref.artifact_id} ({self._uri(ref.stage, ref.artifact_id)}): {problem}")
        chash = manifest.get("content_hash") or content_hash(manifest["files"])
        if chash != ref.content_hash:
            raise ArtifactError(
                f"artifact {ref.artifact_id} ({self._uri(ref.stage, ref.artifact_id)}) was republished with other "
                f"content since this reference was taken (content hash {ref.content_hash[:16]}, now {chash[:16]})"
            )
        _check_files(self.fs, directory, manifest, "verifying", ref.stage, ref.artifact_id)

    # --- repair -----------------------------------------------------------------------
    def discard(self, stage: str, artifact_id: str) -> None:
        """Remove the artifact ``artifact_id`` of ``stage`` (e.g. a broken one, so that it is
        rebuilt): its manifest.json first, then its files, so that no moment of the removal
        looks published. Nothing happens when there is nothing to remove.

        Raises:
            ValueError: ``artifact_id`` is not an artifact id of ``stage``.
        """
        if not artifact_id.startswith(f"{stage}-") or "/" in artifact_id or artifact_id in (".", ".."):
            raise ValueError(f"{artifact_id!r} is not an artifact id of stage {stage!r}")
        directory = self._dir(stage, artifact_id)
        if not self.fs.exists(directory):
            return
        try:
            self.fs.rm_file(f"{directory}/{MANIFEST}")
        except FileNotFoundError:
            pass
        if self.fs.exists(directory):
            self.fs.rm(directory, recursive=True)
        log.info("discarded artifact %s (%s)", artifact_id, self._uri(stage, artifact_id))

    def clean_stale_tmp(self, stage: str) -> builtins.list[str]:  # list: the method above
        """Remove the temporary publish copies of ``stage`` that killed publishes left behind.

        Local stores: a ``.tmp-*`` directory whose ``.lock`` file no live process holds
        (``flock`` locks die with their process; a running publish holds its own). Object
        stores have no locks: a ``.tmp-*`` prefix whose newest object is older than
        ``stale_tmp_age_s`` is removed. Returns the paths removed.
        """
        if self.is_local:
            return self._clean_stale_tmp_local(Path(self.base) / stage)
        stage_dir = f"{self.base}/{stage}"
        try:
            entries = self.fs.ls(stage_dir, detail=True)
        except FileNotFoundError:
            return []
        removed, now = [], time.time()
        for entry in entries:
            name = entry["name"].rstrip("/")
            if not name.rsplit("/", 1)[-1].startswith(TMP_PREFIX):
                continue
            objects = self.fs.find(name, detail=True)
            if not objects:
                continue
            newest = max(_timestamp(self.fs, info) for info in objects.values())
            if now - newest > self.stale_tmp_age_s:
                self.fs.rm(name, recursive=True)
                removed.append(self.fs.unstrip_protocol(name))
                log.info(
                    "removed stale temporary publish copy %s (newest object %.0f s old)", removed[-1], now - newest
                )
        return removed

    def _clean_stale_tmp_local(self, stage_dir: Path) -> builtins.list[str]:
        if not stage_dir.is_dir():
            return []
        removed = []
        for entry in sorted(stage_dir.glob(f"{TMP_PREFIX}*")):
            if entry.name.endswith(".lock"):
                # A lock without its directory: left by a kill between rename and unlink.
                # Old ones only: a publisher creates its lock file moments before locking it.
                owner = entry.with_name(entry.name.removesuffix(".lock"))
                try:
                    age = time.time() - entry.stat().st_mtime
                except FileNotFoundError:  # removed with its directory above
                    continue
                if not owner.exists() and age > self.stale_tmp_age_s:
                    lock = open_locked(entry, blocking=False)
                    if lock is not None:
                        release(lock)
                continue
            if not entry.is_dir() or not remove_if_unowned(entry):
                continue  # a live publish owns it
            removed.append(str(entry))
            log.info("removed stale temporary publish copy %s", entry)
        return removed


def manifest_inputs(manifest: dict[str, Any]) -> dict[str, ArtifactRef]:
    """The upstream artifacts a manifest records (``manifest["inputs"]``), by input name; an
    entry that does not parse as an ``ArtifactRef`` (an older manifest's) is left out."""
    inputs = {}
    for name, value in (manifest.get("inputs") or {}).items():
        try:
            inputs[name] = ArtifactRef.model_validate(value)
        except ValueError:
            continue
    return inputs
