"""Config sections of the table drivers: a frozen dataclass <-> a ConfigDict section.

A driver's own parameters (the `table` section of a table config, `step_time`, `gap`, ...) are a
frozen keyword-only dataclass; its defaults are the one definition of the section's defaults.
`section_config_dict` writes them into a config file's ConfigDict; `from_section` turns the
section back into the dataclass, naming unknown or missing fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def section_config_dict(cls: type, /, **values: Any) -> ml_collections.ConfigDict:
    """A ConfigDict of `cls`'s fields: each at its default, updated by `values`; fields without
    a default must be given."""
    fields = _fields(cls)
    if unknown := sorted(set(values) - set(fields)):
        raise ValueError(f"{cls.__name__} has no fields {unknown}; expected some of {list(fields)}")
    out = {}
    for name, f in fields.items():
        if name in values:
            out[name] = values[name]
        elif f.default is not dataclasses.MISSING:
            out[name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[name] = f.default_factory()
        else:
            raise ValueError(f"{cls.__name__}.{name} has no default: give it")
    return ml_collections.ConfigDict(out)


def from_section[T](cls: type[T], section: Mapping[str, Any] | ml_collections.ConfigDict, /) -> T:
    """`cls(**section)`; a ValueError names unknown fields and missing required ones."""
    values = section.to_dict() if isinstance(section, ml_collections.ConfigDict) else dict(section)
    fields = _fields(cls)
    if unknown := sorted(set(values) - set(fields)):
        raise ValueError(
            f"unknown {cls.__name__} fields {unknown}; expected some of {list(fields)}"
        )
    missing = [
        name
        for name, f in fields.items()
        if name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{cls.__name__} needs the fields {missing}")
    return cls(**values)
