"""Read a pipeline YAML file into a validated :class:`PipelineConfig`.

A config error is reported once, naming every bad key by its dotted path and, for
enumerated fields, the allowed values; nothing runs before the config validates.
"""

from __future__ import annotations

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


def format_validation_error(err: ValidationError, source: str) -> str:
    """One readable message for all problems of a config: ``key.path: problem``."""
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = tuple(e["loc"])
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "(top level)"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(PipelineConfig, loc)
            hint = f" (allowed keys here: {', '.join(allowed)})" if allowed else ""
            lines.append(f"  {key}: unknown key{hint}")
        elif e["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):
            # A check across keys of a section: its message names the keys; echoing the
            # whole section would bury it.
            lines.append(f"  {key}: {e['msg'].removeprefix('Value error, ')}")
        elif e["type"] in ("model_type", "model_attributes_type") and e.get("input") is None:
            lines.append(f"  {key}: section is empty: give its keys (or remove the line to use the defaults of an optional section)")
        else:
            lines.append(f"  {key}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})")
    return "\n".join(lines)


def load_config(path: str | Path) -> PipelineConfig:
    """Parse and validate ``path``.

    Raises:
        ConfigError: the file is missing, is not YAML, repeats a key, or fails validation
            (message lists each bad key as a dotted path with the allowed keys or values).
    """
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
        raise ConfigError(f"config {p} is not valid UTF-8: byte 0x{data[exc.start]:02x} at line {line}, "
                          f"column {column}") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {p} is not valid YAML: {exc}") from exc
    except (RecursionError, ValueError) as exc:  # nesting too deep; an integer of > 4300 digits
        raise ConfigError(f"config {p} cannot be read: {type(exc).__name__}: {exc}") from None
    if raw is None:
        raise ConfigError(f"config {p} is empty: it needs at least the run, data and model sections")
    if not isinstance(raw, dict):
        raise ConfigError(f"config {p} must be a mapping of sections (run, data, model, ...), got {type(raw).__name__}")
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(p))) from None
