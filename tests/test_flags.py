"""The flag table: every EngineConfig option with a flag is a flag of both commands, and each
flag comes back as the option of the same name."""

from __future__ import annotations

from dataclasses import fields

from glmflash.cli import build_parser as build_cli_parser
from glmflash.engine.options import EngineConfig, engine_flags
from glmflash.server.args import build_parser, engine_options


def _sample(name: str, flag) -> tuple[list[str], object]:
    extra = flag.argparse
    if extra.get("action") == "store_true":
        return [], True
    if "choices" in extra:
        return [extra["choices"][-1]], extra["choices"][-1]
    if extra.get("nargs") == "+":
        return (["3", "5"], [3, 5]) if extra.get("type") else (["a", "b"], ["a", "b"])
    if extra.get("metavar") == "JSON":
        return ['{"image": 2}'], {"image": 2}
    kind = extra.get("type")
    if kind is None:
        return ["x"], "x"
    value = kind("3") if kind.__name__ != "fraction" else kind("0.5")
    return [str(value)], value


def test_every_flagged_option_round_trips_through_both_commands():
    rows = engine_flags()
    assert {name for name, _, _ in rows} == \
        {f.name for f in fields(EngineConfig)} - {"background_loop", "check_integrity"}
    for name, _, flag in rows:
        text, value = _sample(name, flag)
        argv = [f"--{name.replace('_', '-')}", *text]
        served = engine_options(build_parser().parse_args(["--device", "cpu", *argv]))
        generated = engine_options(
            build_cli_parser().parse_args(["generate", "--prompt", "x", *argv]), for_server=False)
        assert generated == {name: value}, name
        if name not in ("tp_size", "ep_size"):
            assert served == {name: value}, name


def test_unset_flags_keep_the_engine_defaults():
    assert engine_options(build_parser().parse_args([])) == {}
    args = build_cli_parser().parse_args(["generate", "--prompt", "x"])
    assert engine_options(args, for_server=False) == {}
