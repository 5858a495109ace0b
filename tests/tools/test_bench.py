"""Tests for kmp.tools.bench and kmp.tools.bench_report, at a tiny size.

Nothing is timed here: the reports are checked on made-up results, the
benchmark on runs too short for its numbers to mean anything.
"""

import pytest

from kmp.tools import bench
from kmp.tools import bench_report


def _tables(text):
    """The Markdown tables in `text`: a list of (header, rows) pairs."""
    tables, current = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if current is None:
            current = (cells, [])
            tables.append(current)
        elif not set(line) <= set("|-"):
            current[1].append(dict(zip(current[0], cells)))
    return tables


def test_run_benchmark_without_float32():
    results = bench.run_benchmark(
        ["mixed_float16"],
        ["custom"],
        steps=2,
        batch_size=8,
        units=4,
        rounds=1,
        warmup_steps=1,
        verbose=False,
    )
    assert [(r["policy"], r["implementation"]) for r in results] == [
        ("mixed_float16", "kmp"),
        ("mixed_float16", "native"),
    ]
    assert results[0]["speedup_vs_float32"] is None
    (_, kmp_rows), _ = _tables(bench_report.format_table(results))
    assert kmp_rows[0]["speed-up vs float32"] == "-"
    assert "float32 was not benchmarked" in bench_report.summarize(results)


# --- Reporting, on made-up results ------------------------------------------


def _result(policy, loop, median_ms, accuracy, implementation="kmp"):
    scaled = policy == "mixed_float16"
    return {
        "policy": policy,
        "loop": loop,
        "implementation": implementation,
        "loss_scaling": scaled,
        "device": "cpu",
        "batch_size": 100,
        "units": 8,
        "warmup_steps": 1,
        "steps": 3,
        "step_times_ms": [median_ms] * 3,
        "median_ms": median_ms,
        "q1_ms": median_ms,
        "q3_ms": median_ms,
        "min_ms": median_ms,
        "max_ms": median_ms,
        "samples_per_second": 100 / (median_ms / 1000),
        "speedup_vs_float32": None,
        "kmp_over_native": None,
        "final_loss": 0.25,
        "test_accuracy": accuracy,
        "losses": [1.0, 0.5, 0.3, 0.25],
        "loss_scales": [4.0, 2.0, 2.0, 2.0] if scaled else None,
        "final_loss_scale": 2.0 if scaled else None,
        "skipped_steps": 1 if scaled else None,
        "skipped_at": [2] if scaled else None,
    }


def _with_comparisons(results):
    bench.add_comparisons(results)
    return results


def test_summary_reports_a_speedup_at_the_same_accuracy():
    results = _with_comparisons(
        [
            _result("float32", "fit", 4.2, 0.969),
            _result("mixed_bfloat16", "fit", 2.0, 0.962),
        ]
    )
    assert bench_report.summarize(results) == (
        "model.fit: mixed_bfloat16 is 2.1x faster than float32 here and "
        "reaches the same accuracy (96.2% vs 96.9%)."
    )


def test_summary_reports_the_honest_opposite():
    results = _with_comparisons(
        [
            _result("float32", "custom", 2.0, 0.97),
            _result("mixed_bfloat16", "custom", 3.0, 0.95),
        ]
    )
    summary = bench_report.summarize(results)
    assert summary.startswith(
        "custom loop: mixed_bfloat16 is 1.5x slower than float32 here and "
        "ends 2.0 points lower in accuracy (95.0% vs 97.0%)."
    )
    assert "16-bit compute pays off" in summary


def test_summary_reports_kmp_against_native_and_skipped_steps():
    results = _with_comparisons(
        [
            _result("mixed_float16", "custom", 5.5, 0.97),
            _result("mixed_float16", "custom", 5.0, 0.97, "native"),
        ]
    )
    summary = bench_report.summarize(results)
    assert (
        "custom loop: kmp's mixed_float16 steps take 10% longer than native "
        "Keras 3's (5.50 vs 5.00 ms/step)" in summary
    )
    assert "(custom loop, kmp) skipped 1 step with inf/NaN" in summary


def test_format_table_puts_native_rows_in_a_second_table():
    results = _with_comparisons(
        [
            _result("float32", "fit", 2.0, 0.97),
            _result("mixed_float16", "fit", 8.0, 0.97),
            _result("mixed_float16", "fit", 4.0, 0.97, "native"),
        ]
    )
    (_, kmp_rows), (_, native_rows) = _tables(
        bench_report.format_table(results)
    )
    assert [r["speed-up vs float32"] for r in kmp_rows] == ["1.00", "0.25"]
    assert kmp_rows[1]["final loss scale"] == "2"
    assert kmp_rows[1]["skipped steps"] == "1"
    assert native_rows[0]["kmp / native"] == "2.00"
    assert native_rows[0]["ms/step (median)"] == "4.00 (4.00-4.00)"


@pytest.mark.parametrize(
    "keyword, value, error, fragment",
    [
        ("policies", ["float32", "int8"], ValueError, "must name only"),
        ("policies", "float32", TypeError, "must be a list of names"),
        ("loops", [], ValueError, "at least one"),
        ("steps", 0, ValueError, "'steps' must be an integer >= 1"),
        ("units", 2.5, TypeError, "'units' must be an integer"),
        ("rounds", 9, ValueError, "'rounds' must be at most 'steps'"),
    ],
    ids=[
        "unknown_policy",
        "policies_string",
        "no_loops",
        "zero_steps",
        "float_units",
        "more_rounds_than_steps",
    ],
)
def test_run_benchmark_rejects_bad_arguments(keyword, value, error, fragment):
    arguments = {"steps": 4, "rounds": 2, "verbose": False, keyword: value}
    with pytest.raises(error, match=fragment):
        bench.run_benchmark(**arguments)


def test_every_configuration_trains_on_the_same_batches():
    results = bench.run_benchmark(
        ["float32"],
        ["fit", "custom"],
        steps=3,
        batch_size=8,
        units=4,
        rounds=1,
        warmup_steps=1,
        native=False,
        verbose=False,
    )
    fit, custom = results
    assert len(fit["losses"]) == len(custom["losses"]) == 1 + 1 + 1 + 3
    assert fit["losses"] == pytest.approx(custom["losses"], rel=1e-3)
    assert fit["steps"] == custom["steps"] == 3


def test_plot_marks_skipped_steps_on_a_log_scale_axis(tmp_path):
    pytest.importorskip("matplotlib")
    results = [
        _result("float32", "fit", 4.0, 0.97),
        _result("mixed_float16", "fit", 2.0, 0.97),
    ]
    results[1].update(
        loss_scales=[4.0, 2.0, 2.0, 2.0], skipped_at=[2], skipped_steps=1
    )
    figure = bench_report.write_plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    scales_axes = figure.axes[1]
    assert scales_axes.get_yscale() == "log"
    (marks,) = [
        line for line in scales_axes.lines if line.get_gid() == "skipped"
    ]
    assert list(marks.get_xdata()) == [2]
    assert list(marks.get_ydata()) == [2.0]
    assert marks.get_marker() == "x"
