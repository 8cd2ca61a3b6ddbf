"""Read a pipeline YAML file into a validated :class:`PipelineConfig`.

A config error is reported once, naming every bad key by its dotted path and, for
enumerated fields, the allowed values; nothing runs before the config validates.

Command-line overrides (``posttrain run CONFIG rl.steps=60 rl.optim.lr=3e-4``, as Hydra and
torchtune take them) edit the YAML mapping before validation, so they meet the same schema
and the same errors; an error caused by one says so.
"""

from __future__ import annotations

import copy
import difflib
import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from config.schema import PipelineConfig


class ConfigError(ValueError):
    """A pipeline config that cannot be used; the message names the file and keys."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error
    (plain PyYAML keeps the last one silently, so an edited setting could be ignored)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    hash(key)
                except TypeError:  # unhashable key: the base class reports it
                    continue
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r} (first given on line {first_line[key] + 1})",
                        key_node.start_mark,
                    )
                first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _allowed_keys(model_cls: Any, loc: tuple) -> list[str] | None:
    """Field names of the model at ``loc`` (so 'extra key' errors can list what is valid)."""
    cls = model_cls
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list of sections
            continue
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        # Optional[Model] -> Model
        for candidate in getattr(ann, "__args__", (ann,)):
            if hasattr(candidate, "model_fields"):
                cls = candidate
                break
        else:
            return None
    return sorted(getattr(cls, "model_fields", {}))


def format_validation_error(
    err: ValidationError, source: str, overrides: Sequence[Override] = (), raw: dict[str, Any] | None = None
) -> str:
    """One readable message for all problems of a config: ``key.path: problem``.

    An unknown key suggests the closest allowed key of its section when one is close enough
    (``difflib.get_close_matches``, ratio >= 0.6: ``stpes`` -> ``steps``), then lists them all.

    A problem at or under a key that one of ``overrides`` set (or in the section holding it,
    for a check across the section's keys) ends with ``(set on the command line: KEY=VALUE)``;
    ``raw`` (the validated mapping) maps pydantic's error locations, which name the tag of a
    tagged section too (``prepare.addition.num_sft``), to the keys of the mapping.
    """
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = tuple(e["loc"])
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "(top level)"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(PipelineConfig, loc)
            close = difflib.get_close_matches(str(loc[-1]), allowed or [], n=1)
            guess = f", did you mean {close[0]!r}?" if close else ""
            hint = f" (allowed keys here: {', '.join(allowed)})" if allowed else ""
            line = f"  {key}: unknown key{guess}{hint}"
        elif e["type"] == "missing":
            line = f"  {key}: required key is missing"
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):
            # A check across keys of a section: its message names the keys; echoing the
            # whole section would bury it.
            line = f"  {key}: {e['msg'].removeprefix('Value error, ')}"
        elif e["type"] in ("model_type", "model_attributes_type") and e.get("input") is None:
            line = f"  {key}: section is empty: give its keys (or remove the line to use the defaults of an optional section)"
        else:
            line = f"  {key}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})"
        causes = [o.text for o in overrides if _caused_by(o.path, _data_path(raw, loc), e)]
        if causes:
            line += f" (set on the command line: {' '.join(causes)})"
        lines.append(line)
    return "\n".join(lines)


def _data_path(raw: Any, loc: tuple) -> tuple:
    """``loc`` without the parts that are no key of ``raw`` on the way down (the tag pydantic
    adds for a tagged union); the last part is kept (an unknown or missing key)."""
    out, node = [], raw
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node):
            node = node[part]
        elif i < len(loc) - 1:
            continue
        out.append(part)
    return tuple(out)


def _caused_by(path: tuple, loc: tuple, error: Mapping[str, Any]) -> bool:
    """Whether the override of ``path`` set what the error at ``loc`` is about: the key or a
    section holding it, or (a check across the keys of the section at ``loc``) a key inside."""
    if loc[: len(path)] == path:
        return True
    across_keys = error["type"] == "value_error" and isinstance(error.get("input"), dict)
    return across_keys and bool(loc) and path[: len(loc)] == loc


@dataclass(frozen=True)
class Override:
    """One command-line override, parsed.

    text: as given (``rl.optim.lr=3e-4``).
    path: the dotted key split into mapping keys (str) and list indices (int):
        ``rl.reward.functions[0].weight`` (or ``...functions.0.weight``) is
        ``("rl", "reward", "functions", 0, "weight")``.
    value: the value read as YAML (``60`` -> 60, ``[1,2]`` -> [1, 2], ``null`` -> None,
        ``{lr: 1e-3}`` -> a mapping); an empty value is the empty string, as in Hydra.
    op: ``"set"`` (``KEY=VALUE`` or ``++KEY=VALUE``: set, creating the key and missing
        sections), ``"add"`` (``+KEY=VALUE``: the key must not be in the file yet) or
        ``"delete"`` (``~KEY``: remove it from the file, so the schema default applies).
    """

    text: str
    path: tuple[str | int, ...]
    value: Any
    op: str


_KEY_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_\-]*)((?:\[\d+\])*)$|(\d+)$")


def parse_override(text: str) -> Override:
    """Parse ``KEY=VALUE``, ``+KEY=VALUE``, ``++KEY=VALUE`` or ``~KEY`` (see :class:`Override`).

    Raises:
        ConfigError: no ``=`` (``~KEY`` excepted), an empty or malformed dotted key, or a
            value that is not valid YAML (the message quotes the override).
    """
    body, op = text, "set"
    if body.startswith("++"):
        body = body[2:]
    elif body.startswith("+"):
        body, op = body[1:], "add"
    elif body.startswith("~"):
        body, op = body[1:], "delete"
    key, eq, raw_value = body.partition("=")
    if op == "delete" and eq:
        raise ConfigError(f"override {text!r}: ~KEY removes a key and takes no value; write ~{key}")
    if op != "delete" and not eq:
        raise ConfigError(
            f"override {text!r} is not KEY=VALUE: write a dotted key, '=' and a YAML value, "
            "e.g. rl.steps=60 or rl.optim.lr=3e-4 (~KEY removes a key)"
        )
    path: list[str | int] = []
    for part in key.strip().split("."):
        m = _KEY_PART.match(part)
        if m is None:
            raise ConfigError(
                f"override {text!r}: {key.strip()!r} is not a dotted key such as rl.optim.lr or "
                "rl.reward.functions[0].weight"
            )
        if m.group(3) is not None:
            path.append(int(m.group(3)))
        else:
            path.append(m.group(1))
            path.extend(int(i) for i in re.findall(r"\d+", m.group(2)))
    value = None
    if op != "delete":
        value = ""  # `key=`: the empty string, as in Hydra
        if raw_value.strip():
            try:
                value = yaml.load(raw_value, Loader=_UniqueKeyLoader)
            except yaml.YAMLError as exc:
                raise ConfigError(f"override {text!r}: the value is not valid YAML: {exc}") from None
            except (RecursionError, ValueError) as exc:  # as for the file: too deep, an integer of > 4300 digits
                raise ConfigError(f"override {text!r}: the value cannot be read: {type(exc).__name__}: {exc}") from None
    return Override(text=text, path=tuple(path), value=value, op=op)


def _dotted(path: Sequence[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def apply_overrides(raw: dict[str, Any], overrides: Sequence[Override]) -> dict[str, Any]:
    """A copy of the YAML mapping ``raw`` with ``overrides`` applied in order (a later one
    wins). Setting a key creates the sections on its path that the file leaves out or sets
    to null; whether the result is a valid config is the schema's to say.

    Raises:
        ConfigError: a key on the path holds a value that is not a section (``rl.steps.x=1``),
            a list index is out of range, ``+KEY`` names a key the file has, or ``~KEY`` one
            it does not have (the message quotes the override).
    """
    out = copy.deepcopy(raw)
    for o in overrides:
        node: Any = out
        for depth, part in enumerate(o.path[:-1]):
            here = _dotted(o.path[: depth + 1])
            if isinstance(node, list):
                if not isinstance(part, int) or not -len(node) <= part < len(node):
                    raise ConfigError(
                        f"override {o.text!r}: {_dotted(o.path[:depth])} is a list of {len(node)}; "
                        f"give an index 0..{len(node) - 1}"
                    )
            elif isinstance(part, int):
                raise ConfigError(f"override {o.text!r}: {_dotted(o.path[:depth]) or 'the config'} is not a list")
            elif o.op == "delete" and part not in node:
                raise ConfigError(f"override {o.text!r}: the config has no key {_dotted(o.path)} to remove")
            elif node.get(part) is None:
                node[part] = {}  # a section the file leaves out (or sets to null)
            child = node[part]
            if not isinstance(child, (dict, list)):
                raise ConfigError(
                    f"override {o.text!r}: {here} is {child!r} in the config, not a section, "
                    f"so it has no key {o.path[depth + 1]!r}"
                )
            node = child
        leaf = o.path[-1]
        if isinstance(node, list):
            if not isinstance(leaf, int) or not -len(node) <= leaf < len(node):
                raise ConfigError(
                    f"override {o.text!r}: {_dotted(o.path[:-1])} is a list of {len(node)}; "
                    f"give an index 0..{len(node) - 1}"
                )
            if o.op == "delete":
                del node[leaf]
            else:
                node[leaf] = o.value
            continue
        if isinstance(leaf, int):
            raise ConfigError(f"override {o.text!r}: {_dotted(o.path[:-1]) or 'the config'} is not a list")
        if o.op == "delete":
            if leaf not in node:
                raise ConfigError(f"override {o.text!r}: the config has no key {_dotted(o.path)} to remove")
            del node[leaf]
        elif o.op == "add" and leaf in node:
            raise ConfigError(
                f"override {o.text!r}: {_dotted(o.path)} is already in the config (set it with {o.text[1:]})"
            )
        else:
            node[leaf] = o.value
    return out


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> PipelineConfig:
    """Parse ``path``, apply ``overrides`` (``KEY=VALUE`` strings, see :func:`parse_override`)
    to its mapping, and validate the result. The config remembers its overrides
    (``PipelineConfig.overrides``); they change fingerprints only through the values they
    change (an override equal to the file's value changes nothing).

    Raises:
        ConfigError: the file is missing, is not YAML, repeats a key, an override is
            malformed or cannot apply, or the result fails validation (message lists each
            bad key as a dotted path with the allowed keys or values, and names the
            override that set it).
    """
    parsed = [parse_override(o) for o in overrides]
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config {p} is a directory; give the YAML file")
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(
            f"config {p} is not valid UTF-8: byte 0x{data[exc.start]:02x} at line {line}, column {column}"
        ) from None
    try:
        stream = io.StringIO(text)
        stream.name = str(p)  # PyYAML's marks name the stream: the file, not "<unicode string>"
        raw = yaml.load(stream, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {p} is not valid YAML: {exc}") from exc
    except (RecursionError, ValueError) as exc:  # nesting too deep; an integer of > 4300 digits
        raise ConfigError(f"config {p} cannot be read: {type(exc).__name__}: {exc}") from None
    if raw is None and not parsed:
        raise ConfigError(f"config {p} is empty: it needs at least the run, data and model sections")
    if not isinstance(raw, dict) and raw is not None:
        raise ConfigError(f"config {p} must be a mapping of sections (run, data, model, ...), got {type(raw).__name__}")
    raw = apply_overrides(raw or {}, parsed)
    try:
        cfg = PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(p), parsed, raw)) from None
    cfg._overrides = tuple(overrides)
    return cfg
