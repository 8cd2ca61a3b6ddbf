"""Render the configuration reference (docs/configuration.md's key table) from the schema.

Generated, not hand-written, so the docs cannot drift from the code; a test checks that
docs/configuration.md contains exactly this text.
"""

from __future__ import annotations

import typing

from pydantic import BaseModel

from config.schema import PipelineConfig


def _type_name(ann) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(ann))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is typing.Annotated:  # LocalPath = Annotated[str, ...]: the type it annotates
        return _type_name(typing.get_args(ann)[0])
    if ann is type(None):
        return "null"
    return getattr(ann, "__name__", str(ann))


def _models(ann) -> list[type[BaseModel]]:
    """The config sections an annotation allows (through Optional, unions and Annotated)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Annotated:
        args = args[:1]
    return [m for a in args for m in _models(a)]


def _members(ann) -> list:
    """The alternatives of a union annotation, through Optional, nesting and Annotated."""
    if typing.get_origin(ann) is typing.Annotated:
        return _members(typing.get_args(ann)[0])
    if typing.get_origin(ann) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return [m for a in typing.get_args(ann) for m in _members(a)]
    return [ann]


def _rows(model: type[BaseModel], prefix: str, instance: BaseModel | None = None) -> list[tuple[str, str, str, str]]:
    """Table rows of ``model``'s keys. ``instance``: the section's default value when the
    parent gives it one (e.g. ``OptimConfig(lr=1e-4)``), whose values are the defaults shown."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        value = getattr(instance, name) if instance is not None else field.default
        nested = _models(ann)
        required = "required" if field.is_required() else "optional"
        if typing.get_origin(ann) is list and len(nested) == 1:  # a list of sections: keys of one item
            default = "required" if field.is_required() else f"`{field.default!r}`"
            rows.append((key, "list of sections", default, field.description or ""))
            rows.extend(_rows(nested[0], f"{key}[]."))
            continue
        listed = [a for a in _members(ann) if typing.get_origin(a) is list]
        if listed and len(nested) == 2:  # one section or a list of them (data.rl_train)
            item = _models(listed[0])[0]
            one = next(m for m in nested if m is not item)
            rows.append((key, "section or list of sections", required, field.description or ""))
            rows.extend(_rows(one, f"{key}."))
            rows.extend(_rows(item, f"{key}[]."))
            continue
        if len(nested) == 1:
            rows.append(
                (key, "section", required, (field.description or nested[0].__doc__ or "").strip().split("\n")[0])
            )
            rows.extend(_rows(nested[0], f"{key}.", value if isinstance(value, BaseModel) else None))
            continue
        for variant in nested:  # a tagged union: one block per `kind`
            kind = typing.get_args(variant.model_fields["kind"].annotation)[0]
            rows.append((key, f"section, `kind: {kind}`", required, (variant.__doc__ or "").strip().split("\n")[0]))
            rows.extend(_rows(variant, f"{key}."))
        if nested:
            continue
        default = "required" if field.is_required() and instance is None else f"`{value!r}`"
        rows.append((key, _type_name(ann), default, field.description or ""))
    return rows


def render_reference() -> str:
    """Markdown table of every config key: type, default, meaning."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, typ, default, desc in _rows(PipelineConfig, ""):
        lines.append(f"| `{key}` | {typ} | {default} | {desc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_reference(), end="")
