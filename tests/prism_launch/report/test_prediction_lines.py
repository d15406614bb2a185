"""The terminal's prediction summary says what span each figure covers: the iteration time is
one steady-state step of the slowest rank, the critical path the whole replayed run."""

from prism_launch.report.build import prediction_lines


def _pred(**kw):
    pred = {"cluster": "cpu_local", "compute_source": "cpu", "iteration_time_s": 0.2153,
            "iteration_times_s": [0.2770, 0.2150, 0.2156],
            "critical_path": {"compute_s": 0.2770, "comm_s": 0.2155, "ranks": [488, 489, 1000, 1001]}}
    pred.update(kw)
    return pred


def test_iteration_time_and_critical_path_name_their_spans():
    head, iteration, path = prediction_lines(_pred())
    assert head.startswith("[bold]predicted on cpu_local[/bold] (cpu compute spans)")
    assert "iteration time 215.30 ms: one step of the whole job" in iteration
    assert "as the slowest rank ends it" in iteration and "median of the steps after the first" in iteration
    assert path.startswith("  critical path over the whole replayed run (3 steps, the first included): "
                           "277.0 ms compute + 215.5 ms communication")
    assert "through ranks [488, 489, 1000, 1001]" in path


def test_long_rank_lists_are_cut_and_counted():
    ranks = list(range(20))
    *_, path = prediction_lines(_pred(critical_path={"compute_s": 1.0, "comm_s": 0.5, "ranks": ranks}))
    assert "through ranks [0, 1, 2, 3, 4, 5, 6, 7] and 12 more" in path


def test_two_steps_say_the_median_covers_both():
    _, iteration, path = prediction_lines(_pred(iteration_times_s=[0.3, 0.2]))
    assert "median of 2 step(s)" in iteration and "(2 steps, the first included)" in path


def test_a_steady_step_line_names_groups_largest_first_and_leaves_out_empty_ones():
    from prism_launch.report.build import step_line

    line = step_line(7, {"compute_s": 0.1, "collective_waits_s": {"DATA_PARALLEL_GROUP": 0.002, "default_pg": 0.0,
                                                                   "TENSOR_MODEL_PARALLEL_GROUP": 0.0067},
                         "p2p_waits_s": 0.0117, "waits_s": 0.0204})
    assert line.startswith("  rank 7, one steady step: compute 100.0 ms")
    assert "TENSOR_MODEL_PARALLEL_GROUP 6.7, DATA_PARALLEL_GROUP 2.0;" in line and "default_pg" not in line
    assert line.endswith("point-to-point waits (bubble, transfers) 11.7 ms")
