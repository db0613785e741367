"""Frozen dataclasses <-> ConfigDict sections: defaults from the dataclass, typed placeholders,
flattened nested classes, and errors naming the bad fields."""

from __future__ import annotations

import dataclasses

import pytest

from trace_jax.rl.config_dict import REQUIRED, field_defaults, from_section, section_config_dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    rate: float = 0.5
    cap: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
    name: str
    sizes: tuple[int, ...] = (1, 2)
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_defaults_come_from_the_fields_and_nested_classes_are_flattened():
    assert field_defaults(Inner) == {"rate": 0.5, "cap": None}
    assert field_defaults(Outer) == {"name": REQUIRED, "sizes": (1, 2), "inner": Inner()}
    # `Outer.inner` is of another class of the section: its fields stand in its place.
    assert field_defaults(Outer, Inner) == {
        "name": REQUIRED, "sizes": (1, 2), "rate": 0.5, "cap": None,
    }  # fmt: skip


def test_a_section_round_trips_its_dataclass():
    section = section_config_dict(Outer, name="a", sizes=(3,))
    assert section.to_dict() == {"name": "a", "sizes": (3,), "inner": Inner()}
    assert from_section(Outer, section) == Outer(name="a", sizes=(3,))
    assert from_section(Inner, {"rate": 2.0}) == Inner(rate=2.0)


def test_none_defaults_are_typed_placeholders_and_values_are_type_checked():
    section = section_config_dict(Inner)
    assert section.cap is None
    section.cap = 3
    with pytest.raises(TypeError):
        section.cap = "three"
    with pytest.raises(TypeError):
        section_config_dict(Inner, rate="fast")


def test_unknown_and_missing_fields_are_named():
    with pytest.raises(ValueError, match=r"unknown Outer \+ Inner fields \['step'\]"):
        section_config_dict(Outer, Inner, name="a", step=9)
    with pytest.raises(ValueError, match=r"Outer\.name has no default: give it"):
        section_config_dict(Outer)
    with pytest.raises(ValueError, match=r"unknown Inner fields \['colour'\]"):
        from_section(Inner, {"colour": "red"})
    with pytest.raises(ValueError, match=r"Outer needs the fields \['name'\]"):
        from_section(Outer, {"sizes": (1,)})
