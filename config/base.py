"""The base of every config section: frozen, unknown keys rejected, numbers checked.

Also the path type of every local path in the config (``LocalPath``: ``~`` expanded,
empty refused). Every section model of the pipeline config derives from ``Strict``.
"""

from __future__ import annotations

import os
import re
import types
import typing
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError


def _number_types(annotation) -> set:
    """The number types (int, float, bool) a field annotation allows, looking through
    ``X | None`` and ``list[X]``."""
    if annotation in (int, float, bool):
        return {annotation}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        return set().union(*(_number_types(a) for a in typing.get_args(annotation)))
    return set()


def _number(value, kinds: set):
    """``value`` for a field of number ``kinds``: exponent strings made ints; bools refused."""
    if isinstance(value, list):
        return [_number(v, kinds) for v in value]
    if isinstance(value, bool) and bool not in kinds:
        raise PydanticCustomError(
            "bool_not_number",
            "expected {what}, not a boolean",
            {"what": "a number" if float in kinds else "an integer"},
        )
    if isinstance(value, str) and int in kinds and float not in kinds:
        try:  # YAML 1.1 reads 1e3 as a string; an exact integer in exponent form is that integer
            exact = Decimal(value.strip().replace("_", ""))
        except InvalidOperation:
            return value
        if exact.is_finite() and exact.adjusted() >= _MAX_DIGITS:  # before int(): 1e1000000 takes a minute
            raise _too_large(value)
        if exact.is_finite() and exact == exact.to_integral_value():
            value = int(exact)
    if isinstance(value, int) and not isinstance(value, bool) and float not in kinds and abs(value) > _MAX_INT:
        raise _too_large(value)
    return value


_MAX_INT = 2**63 - 1
_MAX_DIGITS = len(str(_MAX_INT))  # 19: a number with more integer digits is above 2^63 - 1


def _too_large(value) -> PydanticCustomError:
    return PydanticCustomError("int_too_large", "too large for an integer setting (at most 2^63 - 1)")


_ENV_VAR = re.compile(r"\$(\w+|\{[^}]*\})")


def _local_path(value: str | None) -> str | None:
    """A config path with ``$VAR`` / ``${VAR}`` replaced by the environment variable (a
    variable that is not set is refused, naming it, instead of becoming a literal ``./$VAR``
    directory), then ``~`` and ``file://~`` expanded to the home directory (as fsspec
    does for the artifact store), so every local path of a config means the same directory;
    otherwise kept as given (``./org/name`` is a local directory where ``org/name`` is a hub
    id). Spellings do not split fingerprints: raw inputs enter them by content, and other
    paths inside the working directory in their relative form (``tasks.fingerprint``). An
    empty path is refused (it would silently mean the current directory, or be ignored)."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError("empty path; give a path (or remove the key to use its default)")
    if "$" in value:
        unset = [m.group(1).strip("{}") for m in _ENV_VAR.finditer(value) if m.group(1).strip("{}") not in os.environ]
        if unset:
            raise ValueError(
                f"environment variable ${unset[0]} in {value!r} is not set; export it or write the path out"
            )
        value = os.path.expandvars(value)
    if value.startswith("file://~"):
        return "file://" + os.path.expanduser(value.removeprefix("file://"))
    return os.path.expanduser(value) if value.startswith("~") else value


LocalPath = Annotated[str, AfterValidator(_local_path)]
_REFUSED = object()  # stands in for a refused number value (see Strict._numbers)


class Strict(BaseModel):
    """Base: frozen, unknown keys rejected, numbers finite, booleans not numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="wrap")
    @classmethod
    def _numbers(cls, data, handler):
        # pydantic takes `steps: true` as 1 and `lr: yes` as 1.0: a boolean in a number
        # field is a mistake, not a number. Integer fields also take YAML 1.1's string
        # reading of exponent spellings (PyYAML reads `steps: 1e3` as '1e3'). A model
        # validator, not a field one: pydantic refuses field validators on a discriminator.
        if not isinstance(data, dict):
            return handler(data)
        data, refused = dict(data), {}
        for name, value in data.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            kinds = _number_types(field.annotation) if field is not None else set()
            if kinds - {bool}:
                try:
                    data[name] = _number(value, kinds)
                except PydanticCustomError as e:
                    refused[name] = (value, e)
                    data[name] = _REFUSED  # fails the field's own validation; the section's other keys still run
        if not refused:
            return handler(data)
        errors = [InitErrorDetails(type=e, loc=(name,), input=value) for name, (value, e) in refused.items()]
        try:
            handler(data)
        except ValidationError as exc:  # every other problem of the section, in the same message
            errors += [
                InitErrorDetails(type=PydanticCustomError(d["type"], d["msg"]), loc=d["loc"], input=d["input"])
                for d in exc.errors()
                if d["input"] is not _REFUSED
            ]
        raise ValidationError.from_exception_data(cls.__name__, errors)
