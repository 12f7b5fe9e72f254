"""When speculative decoding drafts: the batch-size limit, the acceptance pause and the speed
check that turns drafting off while it is slower than plain decode (no torch, no model)."""

from __future__ import annotations

import logging

from glmflash.engine import spec_policy
from glmflash.engine.spec_policy import DraftPolicy, SpeedCheck


def _compare(check: SpeedCheck, drafted_s: float, plain_s: float, batch: int = 1,
             plain_batch: int | None = None) -> None:
    """Warm-up and one comparison: drafted steps emit 2 tokens per sequence."""
    while check.phase in ("warmup", "drafts"):
        check.observe(True, batch, 2 * batch, drafted_s)
    assert check.holds_off and check.phase == "plain"
    while check.phase == "plain":
        check.observe(False, plain_batch or batch, plain_batch or batch, plain_s)


def test_slower_drafting_is_held_off_then_measured_again(caplog):
    check = SpeedCheck()
    assert not check.holds_off
    with caplog.at_level(logging.INFO, logger="glmflash.engine.spec_policy"):
        _compare(check, drafted_s=0.030, plain_s=0.002)
    assert check.phase == "slow" and check.holds_off
    assert "drafting off" in caplog.text
    for _ in range(spec_policy.SLOW_PAUSE_STEPS):
        check.tick()
    assert check.phase == "drafts" and not check.holds_off


def test_drafting_that_pays_stays_on_until_the_next_check():
    check = SpeedCheck()
    _compare(check, drafted_s=0.0025, plain_s=0.002)  # 800 vs 500 tokens/s
    assert check.phase == "pays" and not check.holds_off
    for _ in range(spec_policy.RECHECK_STEPS):
        check.tick()
    assert check.phase == "drafts"


def test_a_comparison_across_different_loads_does_not_count():
    check = SpeedCheck()
    _compare(check, drafted_s=0.030, plain_s=0.002, batch=1, plain_batch=8)
    assert check.phase == "drafts" and not check.holds_off


def test_warmup_steps_are_not_measured():
    check = SpeedCheck()
    for _ in range(spec_policy.WARMUP_STEPS):
        check.observe(True, 1, 2, 100.0)  # compiling
    assert check.phase == "drafts" and check.drafted.num_steps == 0


def test_policy_combines_batch_limit_acceptance_and_speed():
    policy = DraftPolicy(max_batch_size=4, min_acceptance=0.2)
    assert policy.allows(4) and not policy.allows(5) and policy.allows(1)
    policy.observe(spec_policy.WINDOW, 0)  # nothing accepted: a pause
    assert not policy.allows(1)
    for _ in range(spec_policy.PAUSE_STEPS):
        policy.tick()
    assert policy.allows(1)
    _compare(policy.speed, drafted_s=0.030, plain_s=0.002)
    assert not policy.allows(1) and not policy.is_drafting


def test_a_disabled_speed_check_never_holds_drafting_off():
    policy = DraftPolicy(max_batch_size=4, min_acceptance=0.2, check_speed=False)
    for _ in range(100):
        policy.speed.observe(True, 1, 2, 1.0)
        policy.speed.observe(False, 1, 1, 0.001)
    assert policy.allows(1)


def test_near_zero_acceptance_warns_of_a_broken_mtp_layer(caplog):
    """A window of first drafts accepted under NEAR_ZERO of the time logs a warning (a broken
    MTP head); one just above it does not, though it may still pause drafting."""
    logger = "glmflash.engine.spec_policy"
    low = DraftPolicy(max_batch_size=4, min_acceptance=0.0)
    with caplog.at_level(logging.INFO, logger=logger):
        low.observe(spec_policy.WINDOW, int(spec_policy.WINDOW * spec_policy.NEAR_ZERO) - 1)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "broken" in warnings[0].getMessage()
    caplog.clear()
    fair = DraftPolicy(max_batch_size=4, min_acceptance=0.5)
    with caplog.at_level(logging.INFO, logger=logger):
        fair.observe(spec_policy.WINDOW, int(spec_policy.WINDOW * spec_policy.NEAR_ZERO) + 1)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "drafting pauses" in caplog.text and not fair.allows(1)
