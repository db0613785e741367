"""Frozen config dataclasses <-> ConfigDict sections: the one conversion between them.

A section of a config file's ConfigDict holds the init fields of one or more frozen keyword-only
dataclasses side by side, each at its dataclass default, so that the dataclass stays the one
definition of every default. `section_config_dict` writes a section; `from_section` turns one
back into its dataclass. A None default is written as a typed placeholder, so that
`--config.<section>.<field>=...` is type-checked for it too. A field whose type is another class
of the same section (`RLConfig.grpo`: `GRPOConfig`) is not a field of the section: that class's
own fields stand beside the others.

Validation: each dataclass's `__post_init__` checks its fields with `Checks`, which raises one
`ConfigError` naming every bad field; `ExperimentConfig.from_config_dict` renames them to the
ConfigDict's dotted settings (`sft.batch_size`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

# The default of a field that has none (`field_defaults`).
REQUIRED = dataclasses.MISSING


class ConfigError(ValueError):
    """A config's violated conditions, each naming the setting it is about.

    where: what was checked ("SFTConfig", "experiment config"). problems: (settings, what is
    wrong) pairs, e.g. (("batch_size",), "must be an int >= 1, got 0"), the settings of a
    conflict together; the message lists them all.
    """

    def __init__(self, where: str, problems: Iterable[tuple[tuple[str, ...], str]]):
        self.where, self.problems = where, tuple(problems)
        text = "; ".join(f"{_listed(s)} {m}" for s, m in self.problems)
        super().__init__(f"invalid {where}: {text}")

    def within(self, section: str) -> list[tuple[tuple[str, ...], str]]:
        """The problems with each setting named `<section>.<setting>`."""
        return [(tuple(f"{section}.{n}" for n in s), m) for s, m in self.problems]


def _listed(names: tuple[str, ...]) -> str:
    """The names as a phrase: a; a and b; a, b and c."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def finite_number(value: Any) -> bool:
    """Whether `value` is a finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class Checks:
    """Collects the violated conditions of a config, to raise them together (`ConfigError`)."""

    def __init__(self, where: str):
        self.where, self.problems = where, []

    def need(self, ok: bool, setting: str | tuple[str, ...], message: str) -> None:
        """Records `message` about `setting` (or several, in conflict) unless `ok`."""
        if not ok:
            self.problems.append(((setting,) if isinstance(setting, str) else setting, message))

    def ints(self, obj: Any, names: Iterable[str], low: int, *, optional: bool = False) -> None:
        """Each of `names` of `obj` is an int >= `low` (or None when `optional`)."""
        for name in names:
            v = getattr(obj, name)
            if optional and v is None:
                continue
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= low
            self.need(ok, name, f"must be an int >= {low}, got {v!r}")

    def number(self, obj: Any, name: str, expected: str, ok, *, optional: bool = False) -> None:
        """`obj.name` is a finite number `x` with `ok(x)` (or None when `optional`); `expected`
        says what `ok` accepts ("> 0", "in [0, 1)")."""
        v = getattr(obj, name)
        if optional and v is None:
            return
        good = finite_number(v) and ok(v)
        self.need(good, name, f"must be {expected}{' or None' * optional}, got {v!r}")

    def one_of(self, obj: Any, name: str, choices: Iterable[str]) -> None:
        choices = sorted(choices)
        v = getattr(obj, name)
        self.need(v in choices, name, f"must be one of {choices}, got {v!r}")

    def raise_any(self) -> None:
        if self.problems:
            raise ConfigError(self.where, self.problems)


def _section_fields(*classes: type) -> dict[str, tuple[type, dataclasses.Field, Any]]:
    """Name -> (its class, field, resolved annotation) of the section of `classes`: their init
    fields in order, less any field whose type is another of `classes` (that class's fields
    stand for it)."""
    out: dict[str, tuple[type, dataclasses.Field, Any]] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init or hints[f.name] in classes:
                continue
            if f.name in out:
                raise ValueError(f"field {f.name!r} of {cls.__name__} is already in the section")
            out[f.name] = (cls, f, hints[f.name])
    return out


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def field_defaults(*classes: type) -> dict[str, Any]:
    """Field -> default of the section holding the fields of `classes` side by side (see the
    module docstring); `REQUIRED` for a field without one."""
    return {name: _default(f) for name, (_, f, _) in _section_fields(*classes).items()}


def _placeholder_type(hint) -> type:
    """The non-None type of an `X | None` annotation (a ConfigDict placeholder's type)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return typing.get_origin(args[0]) or args[0]
    raise TypeError(f"a None default needs an `X | None` annotation; got {hint}")


def _check_known(names: Iterable[str], fields: Mapping[str, Any], classes: tuple[type, ...]):
    """Raises a ValueError naming those of `names` that are not among `fields` of `classes`."""
    if unknown := sorted(set(names) - set(fields)):
        where = " + ".join(cls.__name__ for cls in classes)
        raise ValueError(f"unknown {where} fields {unknown}; expected some of {list(fields)}")


def section_config_dict(*classes: type, **values: Any) -> ml_collections.ConfigDict:
    """The ConfigDict section of the fields of `classes` (see the module docstring): each at its
    default (a None default as a placeholder of its annotated type), then `values`, type-checked
    against the defaults. A field without a default must be given.

    Raises ValueError naming unknown fields, or a field without a default that is not given.
    """
    fields = _section_fields(*classes)
    _check_known(values, fields, classes)
    section = ml_collections.ConfigDict()
    for name, (cls, f, hint) in fields.items():
        default = _default(f)
        if default is REQUIRED and name not in values:
            raise ValueError(f"{cls.__name__}.{name} has no default: give it")
        if default is REQUIRED:
            section[name] = values[name]
        elif default is None:
            section[name] = config_dict.placeholder(_placeholder_type(hint))
        else:
            section[name] = default
    for name, value in values.items():
        if _default(fields[name][1]) is not REQUIRED:
            section[name] = value  # type-checked against the default's type
    return section


def from_section[T](cls: type[T], section: Mapping[str, Any] | ml_collections.ConfigDict, /) -> T:
    """`cls(**section)`; a ValueError names unknown fields and missing required ones."""
    values = section.to_dict() if isinstance(section, ml_collections.ConfigDict) else dict(section)
    fields = _section_fields(cls)
    _check_known(values, fields, (cls,))
    missing = [n for n, (_, f, _) in fields.items() if _default(f) is REQUIRED and n not in values]
    if missing:
        raise ValueError(f"{cls.__name__} needs the fields {missing}")
    return cls(**values)
