"""A trace's recorded script arguments against today's, as a user expects: compared under
today's output-only flags, a refusal naming the flag that differs, the order blamed only when
only the order changed."""

from __future__ import annotations

from prism_launch.config.registry import output_args
from prism_launch.launch.args_match import compare_args

RECIPE = ["--num-layers", "2", "--hidden-size", "64"]


def test_a_flag_declared_output_only_at_emulation_may_take_a_new_value():
    """Captured without trace.ignore_args, emulated with trace.ignore_args=[--out]."""
    recorded = [*RECIPE, "--out", "run1"]
    assert compare_args(recorded, [*RECIPE, "--out", "run2"], output_args(["--out"]), ["--out"]) is None
    assert compare_args(recorded, [*RECIPE, "--out=run2"], output_args(["--out"]), ["--out"]) is None


def test_an_output_only_flag_still_counts_by_its_presence():
    m = compare_args([*RECIPE, "--out", "run1"], RECIPE, output_args(["--out"]), ["--out"])
    assert m is not None and m.flags == ("--out",)


def test_the_refusal_names_the_flag_and_advises_declaring_it():
    m = compare_args([*RECIPE, "--out", "run1"], [*RECIPE, "--out", "run2"], output_args())
    assert m is not None and m.flags == ("--out",) and not m.reordered
    text = m.describe()
    assert "--out: recorded run1, now run2" in text
    assert "trace.ignore_args=[--out]" in text
    assert "(order)" not in text and "order" not in text
    assert "trace.ignore_args=[]" not in text


def test_the_advice_adds_to_the_flags_already_declared():
    m = compare_args([*RECIPE, "--out", "a", "--log", "x"], [*RECIPE, "--out", "b", "--log", "y"],
                     output_args(["--log"]), ["--log"])
    assert m is not None and m.flags == ("--out",)
    assert "trace.ignore_args=[--log,--out]" in m.describe()


def test_a_flag_that_changes_the_computation_is_named_among_ignored_ones():
    m = compare_args([*RECIPE, "--out", "a"], ["--num-layers", "2", "--hidden-size", "128", "--out", "b"],
                     output_args(["--out"]), ["--out"])
    assert m is not None and m.flags == ("--hidden-size",)
    assert m.describe().startswith("script args differ: --hidden-size: recorded 64, now 128 (")


def test_the_order_is_blamed_only_when_only_the_order_differs():
    m = compare_args(["--a", "1", "--b", "2"], ["--b", "2", "--a", "1"], output_args())
    assert m is not None and m.reordered and m.flags == ()
    text = m.describe()
    assert "in order only" in text and "['--a', '1', '--b', '2']" in text and "ignore_args" not in text
    # the same order with a changed value is not an order change
    m = compare_args(["--a", "1", "--b", "2"], ["--a", "1", "--b", "3"], output_args())
    assert m is not None and not m.reordered and "order" not in m.describe()


def test_bare_arguments_cannot_be_declared_output_only():
    m = compare_args(["data1"], ["data2"], output_args())
    assert m is not None and "arguments without a flag" in m.describe() and "ignore_args" not in m.describe()


def test_both_spellings_of_a_flag_match():
    assert compare_args(["--hidden-size=64"], ["--hidden-size", "64"], output_args()) is None
