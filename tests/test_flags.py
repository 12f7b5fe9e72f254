"""The flag table: every EngineConfig option with a flag is a flag of both commands, and each
flag comes back as the option of the same name."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

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


@pytest.mark.parametrize("options,message", [
    (dict(speculative_num_steps=2), "speculative_algorithm (NEXTN)"),
    # The drafting policy's options have no effect without it either.
    (dict(speculative_max_batch_size=4), "speculative_algorithm (NEXTN)"),
    (dict(speculative_min_acceptance=0.5), "speculative_algorithm (NEXTN)"),
    (dict(disable_speculative_speed_check=True), "speculative_algorithm (NEXTN)"),
    (dict(speculative_algorithm="medusa"), "must be one of"),
    (dict(speculative_algorithm="EAGLE", speculative_eagle_topk=2), "must be 1"),
    (dict(speculative_algorithm="NEXTN", speculative_num_steps=0), "must be >= 1"),
    (dict(speculative_algorithm="NEXTN", speculative_num_draft_tokens=1), "must be >= 2"),
    (dict(speculative_algorithm="NEXTN", speculative_num_steps=2,
          speculative_num_draft_tokens=4), "must be speculative_num_steps + 1"),
    (dict(speculative_algorithm="NEXTN", tp_size=2), "needs tp_size 1"),
    (dict(speculative_algorithm="NEXTN", speculative_min_acceptance=1.5), "in [0, 1]"),
    (dict(speculative_algorithm="NEXTN", speculative_max_batch_size=0), "must be >= 1"),
])
def test_speculative_options_are_checked(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**options)


def test_speculative_options_as_sglang_takes_them():
    """EAGLE is NEXTN's alias (either case); a chain of two drafts verifies three tokens."""
    config = EngineConfig(speculative_algorithm="eagle", speculative_num_steps=2,
                          speculative_eagle_topk=1, speculative_num_draft_tokens=3)
    assert config.speculative_algorithm.upper() == "EAGLE"
