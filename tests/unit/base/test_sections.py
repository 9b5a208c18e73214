"""A section's fields are its flags (hetseq/base/sections.py): one declaration
gives the parser's flag, its default and help, and the section's field."""

import argparse
import dataclasses

import pytest

from hetseq.base.sections import Section, flag, given_flags, section


@section
class Example(Section):
    """A section as components declare theirs."""
    width: int = flag(16, type=int, help="units", names=("--units",))
    rates: tuple = flag([0.25], type=float, nargs="+", help="per epoch")
    on: bool = flag(False, action="store_true", help="turn it on")
    derived: int = 0                      # no flag: computed in from_args


def parser():
    out = argparse.ArgumentParser()
    Example.add_args(out)
    return out


def test_a_field_is_its_flag_with_its_aliases_default_and_help():
    args = parser().parse_args([])
    assert (args.width, args.rates, args.on) == (16, [0.25], False)
    assert not hasattr(args, "derived")
    args = parser().parse_args(["--units", "3", "--rates", "1", "2", "--on"])
    assert (args.width, args.rates, args.on) == (3, [1.0, 2.0], True)
    assert "units" in parser().format_help() and "per epoch" in parser().format_help()


def test_a_section_is_read_from_the_flags_frozen():
    args = parser().parse_args(["--rates", "1", "2"])
    cfg = Example.from_args(args, derived=7)
    assert cfg == Example(width=16, rates=(1.0, 2.0), on=False, derived=7)
    assert cfg.flags() == {"width": 16, "rates": (1.0, 2.0), "on": False, "derived": 7}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.width = 3
    assert Example().rates == (0.25,)     # a list default is held as a tuple


NAMES = ["a"]


@section
class Listing(Section):
    """A help that lists a registry's names, read when the parser is built."""
    name: str = flag("a", help=lambda: f"one of: {', '.join(NAMES)}")


def test_a_help_may_be_read_when_the_parser_is_built_and_a_default_is_the_parsers():
    NAMES.append("b")                     # registered after the section was declared
    out = argparse.ArgumentParser()
    Listing.add_args(out)
    assert "one of: a, b" in out.format_help()
    defaults = {action.dest: action.default for action in out._actions}
    assert given_flags(out.parse_args([]), defaults, ["name"]) == []
    assert given_flags(out.parse_args(["--name", "b"]), defaults, ["name"]) == ["--name"]
