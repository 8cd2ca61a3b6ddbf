"""``posttrain push <artifact|config> --repo ORG/NAME``: upload the exported model to the Hugging Face Hub.

What is uploaded is the export stage's ``hf_model/`` directory exactly as the stage wrote it
(config, SafeTensors, tokenizer, generation config and, when the export stage writes one, the
model card ``README.md``): ``HfApi().create_repo(repo, exist_ok=True, private=...)`` then
``upload_folder``. The model reference resolves as :mod:`flows.model_ref` says, always to the
export stage (a config: its current export artifact). ``--dry-run`` lists the files and sizes
that would be uploaded and prints the model card's YAML header, touching no network.

The token is the one huggingface_hub reads (``HF_TOKEN``, else the token ``hf auth login``
stored; ``huggingface_hub.get_token``). Without one, or with ``HF_HUB_OFFLINE=1``, the command
stops with one line before any network call; a failed request ends with one line naming the
endpoint (``HF_ENDPOINT``, default https://huggingface.co).
"""

from __future__ import annotations

import re
from pathlib import Path

from config import ConfigError
from flows.model_ref import add_model_arguments, find_model_artifact, hf_model_dir

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class PushFailed(Exception):
    """The Hub could not be reached or refused the upload (the message names the endpoint)."""

    exit_code = 1


def add_push_parser(sub) -> None:
    """Register ``posttrain push`` on the CLI's subparsers ``sub``."""
    p = sub.add_parser("push", help="upload the exported model (hf_model/) to the Hugging Face Hub")
    add_model_arguments(p)
    p.add_argument("--repo", required=True, metavar="ORG/NAME", help="the Hub model repository (created if missing)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded; no network")
    p.set_defaults(fn=cmd_push)


def upload_files(directory: Path) -> list[tuple[str, int]]:
    """``[(path relative to directory, bytes), ...]`` of every file under ``directory``, sorted:
    what ``upload_folder`` uploads (it skips nothing here: the export holds no ``.git``)."""
    return sorted((p.relative_to(directory).as_posix(), p.stat().st_size) for p in directory.rglob("*") if p.is_file())


def card_header(readme: Path) -> str | None:
    """The YAML front matter of a model card (between the leading ``---`` lines), or None when
    ``readme`` is missing or has none."""
    if not readme.is_file():
        return None
    text = readme.read_text(encoding="utf-8")
    match = re.match(r"^---\r?\n(.*?\r?\n)?---\r?\n", text, flags=re.S)
    return (match.group(1) or "") if match else None


def hub_token_problem() -> str | None:
    """Why no upload can start (offline mode, no token), or None. Reads no network."""
    # huggingface_hub: its client takes ~0.4 s to import; only Hub calls need it
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        return (
            "HF_HUB_OFFLINE is set: push needs the network; unset HF_HUB_OFFLINE (or use --dry-run to list the files)"
        )
    if not get_token():
        return "no Hugging Face token: set HF_TOKEN (a write token from https://huggingface.co/settings/tokens) or run `hf auth login`"
    return None


def cmd_push(args) -> int:
    """Upload (``--dry-run``: list) the export directory. Returns 0, or 1 when the Hub call failed.

    Raises:
        ConfigError: a bad ``--repo``, a model reference that is not an export, offline mode
            or no token (before any network call).
    """
    if not REPO_ID.match(args.repo):
        raise ConfigError(f"--repo {args.repo!r}: expected ORG/NAME (letters, digits, '-', '_', '.')")
    if args.stage not in (None, "export"):
        raise ConfigError(f"--stage {args.stage}: push uploads the export stage's hf_model/; drop --stage")
    artifact = find_model_artifact(args.model, args.overrides, stage="export", artifact_root=args.artifact_root)
    directory = hf_model_dir(artifact)
    files = upload_files(directory)
    # rich (via flows.gc): its console and tables take ~0.1 s to import; only printing needs them
    from flows.gc import human_size

    where = f"https://huggingface.co/{args.repo}" if not args.dry_run else args.repo
    total = human_size(sum(size for _, size in files))
    if args.dry_run:
        print(
            f"would upload {len(files)} files ({total}) from {directory} ({artifact.name}) to {where}"
            f"{' (private)' if args.private else ''}:"
        )
        for path, size in files:
            print(f"  {path}  {human_size(size)}")
        header = card_header(directory / "README.md")
        if header is not None:
            print("model card header (README.md):")
            print("---\n" + header + "---")
        elif (directory / "README.md").is_file():
            print("note: README.md has no YAML header (the Hub shows no metadata for it)")
        else:
            print("note: no README.md (model card) in the export; the Hub shows an empty card")
        return 0
    problem = hub_token_problem()
    if problem:
        raise ConfigError(problem)
    try:
        _upload(directory, args.repo, args.private, artifact.name)
    except PushFailed as exc:
        print(f"error: {exc}", flush=True)
        return exc.exit_code
    print(f"uploaded {len(files)} files ({total}) of {artifact.name} to {where}")
    return 0


def _upload(directory: Path, repo: str, private: bool, name: str) -> None:
    # huggingface_hub: its client takes ~0.4 s to import; only Hub calls need it
    from huggingface_hub import HfApi, constants

    api = HfApi()
    try:
        api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(
            repo_id=repo, repo_type="model", folder_path=str(directory), commit_message=f"posttrain export {name}"
        )
    except Exception as exc:  # HfHubHTTPError, httpx's connection errors, OSError
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise PushFailed(f"upload to {constants.ENDPOINT} ({repo}) failed: {type(exc).__name__}: {detail}") from exc
