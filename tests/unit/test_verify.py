"""``freescale verify``'s comparison (bitwise, per kind of state, NaNs and signed zeros included),
the first difference it names, the pipelines it accepts, and its verdict."""

import math

import pytest
import torch

from freescale.config import ConfigError
from freescale.train.pairs import TABLES_OF, pipeline_pair
from freescale.train.verify import Difference, Verdict, compare, earliest, print_verdict
from helpers.launch import REPO, freescale_without_torch


def state(weight, momentum=None, dense=None):
    return {"embedding rows": {"weight": weight},
            "embedding optimizer state": {"momentum": momentum if momentum is not None else torch.zeros(3)},
            "dense parameters": {"w": dense if dense is not None else torch.ones(2, 2)},
            "dense optimizer state": {"w.step": torch.tensor(3.0)}}


def test_identical_runs_compare_equal():
    w = torch.randn(3, 4)
    steps, worst, first = compare([0.5, 0.25], [0.5, 0.25], state(w), state(w.clone()))
    assert first is None and steps == [0.0, 0.0] and set(worst.values()) == {0.0}


def test_one_ulp_anywhere_is_a_difference():
    w = torch.randn(3, 4)
    nudged = w.clone()
    nudged[1, 2] = torch.nextafter(w[1, 2], torch.tensor(math.inf))
    c = compare([0.5], [0.5], state(w), state(nudged))
    assert not c.equal and 0 < c.state_diffs["embedding rows"] < 1e-6 and c.state_diffs["dense parameters"] == 0.0
    c = compare([0.5], [0.5], state(w, dense=torch.ones(2, 2)), state(w, dense=torch.ones(2, 2) * 1.5))
    assert not c.equal and c.state_diffs["dense parameters"] == 0.5
    c = compare([0.5, 0.25], [0.5, 0.25000001], state(w), state(w))
    assert not c.equal and c.step_diffs[0] == 0.0 and c.step_diffs[1] > 0


def test_nans_and_signed_zeros_are_not_equal():
    w = torch.zeros(3, 4)
    assert not compare([float("nan")], [float("nan")], state(w), state(w)).equal
    assert not compare([0.0], [-0.0], state(w), state(w)).equal
    assert not compare([0.5], [0.5], state(w), state(-w)).equal
    nan = torch.full((3, 4), float("nan"))
    c = compare([0.5], [0.5], state(nan), state(torch.zeros(3, 4)))
    assert not c.equal and c.state_diffs["embedding rows"] == math.inf


def test_missing_or_reshaped_state_is_a_difference():
    w = torch.randn(3, 4)
    other = state(w)
    other["dense parameters"] = {}
    assert not compare([0.5], [0.5], state(w), other).equal
    c = compare([0.5], [0.5], state(w), state(torch.randn(4, 3)))
    assert not c.equal and c.state_diffs["embedding rows"] == math.inf


def test_nan_against_nan_in_the_state_is_not_equal():
    # The same bits on both sides: only the NaN guard keeps two runs that diverged alike apart.
    nan = torch.full((3, 4), float("nan"))
    c = compare([0.5], [0.5], state(nan), state(nan.clone()))
    assert not c.equal and c.state_diffs["embedding rows"] == math.inf


def test_an_extra_key_is_a_difference():
    w = torch.randn(3, 4)
    extra = state(w)
    extra["dense parameters"]["b"] = torch.zeros(2)
    assert not compare([0.5], [0.5], state(w), extra).equal


def test_a_verdict_holds_bit_for_bit_or_within_a_stated_tolerance():
    close = Verdict(steps=2, losses={}, step_diffs=[0.0, 2e-7], state_diffs={"rows": 5e-7})
    assert not close.within(0.0)  # the default: bit for bit
    assert close.within(1e-6) and not close.within(1e-7)
    assert Verdict(steps=1, losses={}, step_diffs=[0.0], identical=True).within(0.0)
    for bad in (math.nan, math.inf):
        assert not Verdict(steps=1, losses={}, step_diffs=[bad], state_diffs={"rows": 0.0}).within(1.0)
        assert not Verdict(steps=1, losses={}, step_diffs=[0.0], state_diffs={"rows": bad}).within(1.0)


def test_a_difference_the_bits_show_but_the_magnitude_does_not_fails_at_tolerance_0():
    # -0.0 against 0.0 (or keys that differ in name only) differs by 0: only identical may pass at 0.
    signed_zero = compare([0.0], [-0.0], state(torch.zeros(3, 4)), state(torch.zeros(3, 4)))
    verdict = Verdict(steps=1, losses={}, step_diffs=signed_zero.step_diffs, state_diffs=signed_zero.state_diffs,
                      identical=signed_zero.equal)
    assert [*verdict.step_diffs, *verdict.state_diffs.values()] == [0.0] * 5
    assert not verdict.within(0.0) and verdict.within(1e-9)


def test_the_first_difference_is_the_first_step_whose_loss_differs():
    w = torch.randn(3, 4)
    c = compare([0.5, 0.25, 0.125], [0.5, 0.3, 0.1], state(w), state(w + 1), rank=1)
    assert c.first == Difference(rank=1, step=2, a="0.25", b="0.3")
    c = compare([0.5, -0.0], [0.5, 0.0], state(w), state(w))
    assert (c.first.step, c.first.a, c.first.b) == (2, "-0.0", "0.0")
    assert compare([0.5, math.nan], [0.5, math.nan], state(w), state(w)).first.step == 2


def test_else_the_first_differing_value_of_the_state_by_kind_key_and_flat_index():
    w = torch.arange(12.0).reshape(3, 4)
    got = w.clone()
    got[1, 2] = 100.0  # flat index 6
    got[2, 0] = 200.0
    c = compare([0.5], [0.5], state(w, dense=torch.ones(2, 2)), state(got, dense=torch.zeros(2, 2)))
    assert c.first == Difference(rank=0, step=0, kind="embedding rows", key="weight", index=6, a="6.0", b="100.0")
    # Kinds in order: the dense parameters differ only after the rows agree.
    c = compare([0.5], [0.5], state(w, dense=torch.ones(2, 2)), state(w, dense=torch.tensor([[1.0, 1.0], [-1.0, 1.0]])))
    assert (c.first.kind, c.first.key, c.first.index, c.first.a, c.first.b) == ("dense parameters", "w", 2, "1.0", "-1.0")
    # A signed zero and a NaN on both sides are differences at their index; a missing key names itself.
    zeros = torch.zeros(3, 4)
    assert compare([0.5], [0.5], state(zeros), state(zeros.clone().index_fill_(1, torch.tensor([3]), -0.0))).first.index == 3
    nan = zeros.clone()
    nan[0, 1] = math.nan
    assert compare([0.5], [0.5], state(nan), state(nan.clone())).first.index == 1
    other = state(w)
    del other["dense parameters"]["w"]
    assert compare([0.5], [0.5], state(w), other).first == Difference(0, 0, "dense parameters", "w", -1, "float32 (2, 2)",
                                                                      "absent")


def test_every_difference_compare_counts_names_a_first_one():
    w = torch.randn(3, 4)
    for a, b in [(state(w), state(w.clone())), (state(w), state(-w)), (state(w), state(torch.randn(4, 3)))]:
        for losses in ([0.5], [0.25]):
            c = compare([0.5], losses, a, b)
            assert c.equal == (c.first is None)
            assert c.equal == (all(d == 0 for d in c.step_diffs) and all(d == 0 for d in c.state_diffs.values()))


def test_the_earliest_step_on_any_rank_comes_first_else_the_first_rank_in_the_state():
    state_on_0 = Difference(0, 0, "dense parameters", "w", 0, "1.0", "2.0")
    step_3_on_0, step_2_on_1, step_2_on_2 = Difference(0, 3, a="1", b="2"), Difference(1, 2), Difference(2, 2)
    assert earliest([step_3_on_0, step_2_on_2, step_2_on_1]) == step_2_on_1
    assert earliest([state_on_0, step_2_on_2]) == step_2_on_2
    state_on_1 = state_on_0._replace(rank=1)
    assert earliest([None, state_on_1, state_on_0._replace(rank=2)]) == state_on_1
    assert earliest([None, None]) is None


def test_the_verdict_prints_both_pipelines_and_its_first_difference(capsys):
    first = Difference(1, 0, "embedding rows", "item_ec.embeddings.item_table.weight", 42, "0.5", "0.25")
    verdict = Verdict(steps=2, losses={"sparse_dist": [0.7, 0.6], "base": [0.7, 0.6]}, step_diffs=[0.0, 0.0],
                      state_diffs={"embedding rows": 0.25}, first=first)
    print_verdict(verdict)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["step", "loss", "(sparse_dist)", "loss", "(base)", "max", "|diff|"]
    assert "on cpu: NOT bitwise identical" in out
    assert out[-1] == ("first difference: embedding rows item_ec.embeddings.item_table.weight [flat index 42] on rank 1: "
                       "0.5 (sparse_dist) against 0.25 (base)")
    print_verdict(Verdict(steps=1, losses={"sync": [0.7], "prioritized": [0.7]}, step_diffs=[0.0], identical=True,
                          collision_rates={"prioritized": 0.5}))
    out = capsys.readouterr().out
    assert "bitwise identical" in out and "NOT" not in out and "first difference" not in out
    assert "mean collision rate of prioritized (per owner, per step): 50.0%" in out


@pytest.mark.parametrize("text,fragment", [
    ("sync", "expected two pipelines as A,B"),
    ("sync,prioritized,base", "expected two pipelines as A,B"),
    ("sync,", "expected two pipelines as A,B"),
    ("sync,nope", "unknown pipeline 'nope'"),
    ("base,base", "base twice"),
    ("sync,base", "sync trains FreeScale's own tables and base TorchRec's tables"),
])
def test_pipelines_are_two_different_registered_ones_over_the_same_tables(text, fragment):
    with pytest.raises(ConfigError, match="^--pipelines: ") as e:
        pipeline_pair(text)
    assert fragment in str(e.value)


def test_pipeline_pairs():
    assert pipeline_pair("sync,prioritized") == ("sync", "prioritized")
    assert pipeline_pair("sparse_dist, base") == ("sparse_dist", "base")
    assert pipeline_pair("prioritized,sync") == ("prioritized", "sync")


def test_each_pipelines_tables_are_named_as_its_class_names_them():
    from typing import get_args, get_type_hints

    from freescale.config import TrainConfig
    from freescale.train.pipelines import PIPELINES

    assert set(TABLES_OF) == set(PIPELINES) == set(get_args(get_type_hints(TrainConfig)["pipeline"]))
    assert TABLES_OF == {name: cls.table_kind.description for name, cls in PIPELINES.items()}


@pytest.mark.parametrize("args, fragment", [
    (["--pipelines=sync,base"], "--pipelines: sync trains FreeScale's own tables and base TorchRec's tables"),
    (["--ft.enable=true"], "ft.enable: freescale verify trains both runs on the same ranks"),
    (["--set-b", "run.threads=3"], "run.threads: both runs share the job's"),
    (["--tolerance=-1"], "--tolerance: expected a number at least 0"),
])
def test_verify_refuses_bad_arguments_before_it_imports_torch(args, fragment):
    # torch made unimportable: the command must have said what is wrong before it needed torch.
    proc = freescale_without_torch("verify", "--config", str(REPO / "configs" / "quickstart.yaml"), *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("freescale: error: ") and fragment in line
