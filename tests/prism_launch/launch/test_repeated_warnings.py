"""A third-party warning that every rank prints reaches the console once; the rank logs keep
every copy, and the launcher says how many it hid and where they are."""

import io

from torch.distributed.elastic.multiprocessing.api import Std

from prism_launch.launch import rank_logs

APEX = ("/venv/lib/python3.11/site-packages/megatron/core/fusions/fused_layer_norm.py:34: UserWarning: "
        "Apex is not installed. Falling back to Torch Norm\n")
APEX_SRC = '  warnings.warn("Apex is not installed. Falling back to Torch Norm")\n'
SCOPE = ("/venv/lib/python3.11/site-packages/megatron/training/arguments.py:1112: DeprecationWarning: "
         "cuda_graph_scope is deprecated\n")
SCOPE_SRC = "  warnings.warn(\n"


def _relay(tmp_path, monkeypatch, per_rank: dict[int, list[str]], warnings=None) -> tuple[str, rank_logs.Tee]:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    ranks = []
    for rank, lines in per_rank.items():
        d = tmp_path / "logs" / str(rank)
        d.mkdir(parents=True)
        (d / "stderr.log").write_text("".join(lines))
        ranks.append((rank, Std.ERR, None, d / "stderr.log"))
    tee = rank_logs.start_tee(ranks, warnings if warnings is not None else rank_logs.RepeatedWarnings())
    tee.stop()
    return err.getvalue(), tee


def test_two_ranks_identical_warning_is_shown_once(tmp_path, monkeypatch):
    lines = [APEX, APEX_SRC, "step 1 | loss 4.87\n"]
    out, tee = _relay(tmp_path, monkeypatch, {0: lines, 1: lines})
    shown = out.splitlines()
    assert sum("Apex is not installed" in ln for ln in shown) == 2  # rank 0's warning and its source line
    assert [ln for ln in shown if ln.startswith("[default0]:")] == [
        "[default0]:" + APEX.rstrip("\n"), "[default0]:" + APEX_SRC.rstrip("\n"), "[default0]:step 1 | loss 4.87"]
    assert [ln for ln in shown if ln.startswith("[default1]:")] == ["[default1]:step 1 | loss 4.87"]
    assert (tee.hidden, tee.hidden_ranks) == (1, {1})
    assert shown[-1] == (f"prism-launch: 1 repeated warning from 1 rank hidden (each shown once); "
                         f"see {tmp_path / 'logs'}/<rank>/stderr.log")
    # the log files keep every copy
    assert (tmp_path / "logs" / "1" / "stderr.log").read_text().count("Apex is not installed") == 2


def test_only_warnings_are_collapsed_and_other_repeats_stay(tmp_path, monkeypatch):
    same = ["loss 4.874436378479004\n", "    indented program output\n"]
    out, tee = _relay(tmp_path, monkeypatch, {0: same, 1: same, 2: [SCOPE, SCOPE_SRC, "done\n"],
                                              3: [SCOPE, SCOPE_SRC, "  not a source line after output\n"]})
    assert out.count("loss 4.874436378479004") == 2 and out.count("indented program output") == 2
    assert out.count("cuda_graph_scope is deprecated") == 1 and out.count("warnings.warn(") == 1
    assert "[default3]:  not a source line after output" in out  # only the one source line under it is dropped
    assert tee.hidden == 1 and "prism-launch: 1 repeated warning" in out


def test_a_warning_shown_by_an_earlier_phase_is_not_shown_again(tmp_path, monkeypatch):
    shown = rank_logs.RepeatedWarnings()
    first, _ = _relay(tmp_path / "discover", monkeypatch, {5: [APEX, APEX_SRC]}, shown)
    second, tee = _relay(tmp_path / "capture", monkeypatch, {5: [APEX, APEX_SRC, "ok\n"], 6: [APEX, APEX_SRC]}, shown)
    assert "Apex" in first and "Apex" not in second.replace("hidden", "")
    assert tee.hidden == 2 and tee.hidden_ranks == {5, 6}
    assert "2 repeated warnings from 2 ranks hidden" in second


def test_no_note_when_nothing_was_hidden(tmp_path, monkeypatch):
    out, tee = _relay(tmp_path, monkeypatch, {0: [APEX, APEX_SRC]})
    assert tee.hidden_note() == "" and "prism-launch:" not in out
