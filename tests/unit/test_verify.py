"""``freescale verify``'s comparison: bitwise, per kind of state, NaNs and signed zeros included."""

import math

import torch

from freescale.train.verify import compare


def state(weight, momentum=None, dense=None):
    return {"embedding rows": {"weight": weight},
            "embedding optimizer state": {"momentum": momentum if momentum is not None else torch.zeros(3)},
            "dense parameters": {"w": dense if dense is not None else torch.ones(2, 2)},
            "dense optimizer state": {"w.step": torch.tensor(3.0)}}


def test_identical_runs_compare_equal():
    w = torch.randn(3, 4)
    steps, worst, equal = compare([0.5, 0.25], [0.5, 0.25], state(w), state(w.clone()))
    assert equal and steps == [0.0, 0.0] and set(worst.values()) == {0.0}


def test_one_ulp_anywhere_is_a_difference():
    w = torch.randn(3, 4)
    nudged = w.clone()
    nudged[1, 2] = torch.nextafter(w[1, 2], torch.tensor(math.inf))
    steps, worst, equal = compare([0.5], [0.5], state(w), state(nudged))
    assert not equal and 0 < worst["embedding rows"] < 1e-6 and worst["dense parameters"] == 0.0
    _, worst, equal = compare([0.5], [0.5], state(w, dense=torch.ones(2, 2)), state(w, dense=torch.ones(2, 2) * 1.5))
    assert not equal and worst["dense parameters"] == 0.5
    steps, _, equal = compare([0.5, 0.25], [0.5, 0.25000001], state(w), state(w))
    assert not equal and steps[0] == 0.0 and steps[1] > 0


def test_nans_and_signed_zeros_are_not_equal():
    w = torch.zeros(3, 4)
    assert not compare([float("nan")], [float("nan")], state(w), state(w))[2]
    assert not compare([0.0], [-0.0], state(w), state(w))[2]
    assert not compare([0.5], [0.5], state(w), state(-w))[2]
    nan = torch.full((3, 4), float("nan"))
    _, worst, equal = compare([0.5], [0.5], state(nan), state(torch.zeros(3, 4)))
    assert not equal and worst["embedding rows"] == math.inf


def test_missing_or_reshaped_state_is_a_difference():
    w = torch.randn(3, 4)
    other = state(w)
    other["dense parameters"] = {}
    assert not compare([0.5], [0.5], state(w), other)[2]
    _, worst, equal = compare([0.5], [0.5], state(w), state(torch.randn(4, 3)))
    assert not equal and worst["embedding rows"] == math.inf


def test_nan_against_nan_in_the_state_is_not_equal():
    # The same bits on both sides: only the NaN guard keeps two runs that diverged alike apart.
    nan = torch.full((3, 4), float("nan"))
    steps, worst, equal = compare([0.5], [0.5], state(nan), state(nan.clone()))
    assert not equal and worst["embedding rows"] == math.inf


def test_an_extra_key_is_a_difference():
    w = torch.randn(3, 4)
    extra = state(w)
    extra["dense parameters"]["b"] = torch.zeros(2)
    assert not compare([0.5], [0.5], state(w), extra)[2]


def test_a_verdict_holds_bit_for_bit_or_within_a_stated_tolerance():
    from freescale.train.verify import Verdict

    close = Verdict(steps=2, losses={}, step_diffs=[0.0, 2e-7], state_diffs={"rows": 5e-7})
    assert not close.within(0.0)  # the default: bit for bit
    assert close.within(1e-6) and not close.within(1e-7)
    assert Verdict(steps=1, losses={}, step_diffs=[0.0], identical=True).within(0.0)
    for bad in (math.nan, math.inf):
        assert not Verdict(steps=1, losses={}, step_diffs=[bad], state_diffs={"rows": 0.0}).within(1.0)
        assert not Verdict(steps=1, losses={}, step_diffs=[0.0], state_diffs={"rows": bad}).within(1.0)
