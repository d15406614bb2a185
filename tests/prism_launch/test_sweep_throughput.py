"""A sweep's summary carries MFU and tokens/s per GPU, and ranks the points by their prediction."""

import csv
import io

from prism_launch.sweep import fastest_point, print_table, summarize_report, write_summary


def _report(it, mfu, tok_gpu):
    return {"world_size": 8, "ranks": {},
            "predicted": {"iteration_time_s": it, "oom_ranks": [],
                          "throughput": {"mfu": mfu, "tokens_per_s_per_gpu": tok_gpu, "tokens_per_s": tok_gpu * 8,
                                         "model_tflops_per_gpu": 989 * mfu if mfu is not None else None}}}


def _rows():
    rows = []
    for i, rep in enumerate([_report(0.30, 0.20, 1000.0), _report(0.10, 0.60, 3000.0), None]):
        row = {"point": i, "overrides": [f"target.parallel.tp={2 ** i}"], "status": "ok"}
        if rep is None:
            row["status"] = "failed: boom"
        else:
            row.update(summarize_report(rep))
        rows.append(row)
    return rows


def test_summary_csv_has_mfu_tokens_and_the_rank_by_prediction(tmp_path):
    csv_path, png_path = write_summary(_rows(), tmp_path)
    got = list(csv.DictReader(open(csv_path)))
    for col in ("rank", "mfu", "tokens_per_s_per_gpu", "tokens_per_s", "model_tflops_per_gpu"):
        assert col in got[0], col
    assert [r["rank"] for r in got] == ["2", "1", ""]  # the 0.10 s point is the fastest; a failed one unranked
    assert got[1]["mfu"] == "0.6" and got[1]["tokens_per_s_per_gpu"] == "3000.0"
    assert png_path.read_bytes()[:4] == b"\x89PNG"


def test_the_fastest_point_is_marked_and_the_table_shows_mfu():
    rows = _rows()
    ok = [(r, "x") for r in rows if r["status"] == "ok"]
    assert fastest_point(ok) == 1
    buf = io.StringIO()
    print_table(rows, file=buf)
    text = buf.getvalue()
    assert "MFU" in text and "60.0%" in text and "3,000.0" in text
    assert text.index("60.0%") < text.index("20.0%")  # ranked by the prediction


def test_a_host_bound_point_carries_its_step_on_a_host_that_keeps_up(tmp_path):
    rep = _report(0.8, 0.06, 1200.0)
    rep["predicted"]["host_kept_up"] = {"iteration_time_s": 0.5, "busy_share": 0.54, "speedup": 1.6}
    rows = [{"point": 0, "overrides": [], "status": "ok", **summarize_report(rep)},
            {"point": 1, "overrides": [], "status": "ok", **summarize_report(_report(0.6, 0.1, 1500.0))}]
    got = list(csv.DictReader(open(write_summary(rows, tmp_path)[0])))
    assert [r["iteration_time_host_kept_up_s"] for r in got] == ["0.5", ""]
