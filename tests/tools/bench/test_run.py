"""Tests for kmp.tools.bench.run and kmp.tools.bench.report, at a tiny size, on
every backend.

Nothing is timed here: the reports are checked on made-up results, the
benchmark on runs too short for its numbers to mean anything, the step
planning on made-up step times.
"""

import keras
import pytest

from kmp.tools.bench import report as bench_report
from kmp.tools.bench import run as bench
from kmp.tools.bench import stats as bench_stats
from kmp.tools.bench.configuration import Configuration
from kmp.tools.bench.configuration import backend_module
from tests.support import backends

# With -n: one worker runs this module, so its shared run is made once.
pytestmark = pytest.mark.xdist_group("bench_run")

TINY = {"batch_size": 8, "units": 4, "verbose": False}


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


@pytest.fixture(scope="module")
def mixed_float16_run():
    """One run serves the tests of the rows a configuration adds: kmp's,
    Keras's own loss scaling (native), and kmp without loss scaling
    (overhead), with memory measured; float32 is left out."""
    return bench.run_benchmark(
        ["mixed_float16"],
        ["custom"],
        steps=100,
        warmup_steps=1,
        overhead=True,
        torch_amp=False,
        memory=True,
        **TINY,
    )


def test_run_benchmark_without_float32(mixed_float16_run):
    results = mixed_float16_run
    assert [(r["policy"], r["implementation"]) for r in results] == [
        ("mixed_float16", "kmp"),
        ("mixed_float16", "native"),
        ("mixed_float16", "unscaled"),
    ]
    assert results[0]["speedup_vs_float32"] is None
    assert results[0]["backend"] == keras.backend.backend()
    _, kmp_rows = _tables(bench_report.format_table(results))[0]
    assert kmp_rows[0]["speed-up vs float32"] == "-"
    assert "float32 was not benchmarked" in bench_report.summarize(results)


def test_every_configuration_trains_on_the_same_batches():
    results = bench.run_benchmark(
        ["float32"],
        ["fit", "custom"],
        steps=100,
        warmup_steps=1,
        native=False,
        torch_amp=False,
        **TINY,
    )
    fit, custom = results
    # The first call, the warm-up, one untimed step per round, the timed.
    assert len(fit["losses"]) == len(custom["losses"]) == 1 + 1 + 5 + 100
    # fit's running means, recovered per step, follow the custom loop's.
    assert fit["losses"] == pytest.approx(custom["losses"], rel=1e-3)
    assert fit["steps"] == custom["steps"] == 100


# The budget's arithmetic and its message: the same on every backend.
@pytest.mark.anybackend
def test_without_steps_the_budget_decides_them(capsys):
    results = bench.run_benchmark(
        ["float32", "mixed_float16"],
        ["custom"],
        budget_seconds=0.5,
        warmup_steps=2,
        native=False,
        torch_amp=False,
        **dict(TINY, verbose=True),
    )
    # Half a second holds fewer than the fewest steps: it says so, and
    # times them anyway (never a median of fewer).
    output = capsys.readouterr().out
    assert "The budget (0.5 s) cannot hold 5 rounds of 20 timed steps" in (
        output
    )
    assert "Compilation and warm-up (untimed, not in the budget): " in output
    for r in results:
        assert r["rounds"] == bench_stats.MIN_ROUNDS
        assert bench_stats.MIN_STEPS <= r["steps"] <= bench.MAX_BUDGET_STEPS
        assert 1 <= r["warmup_steps"] <= 2
        # The first call, the warm-up, a step per round, the timed steps.
        expected = 1 + r["warmup_steps"] + r["rounds"] + r["steps"]
        assert len(r["losses"]) == expected
    assert len({r["steps"] for r in results}) == 1


@pytest.mark.parametrize("model", ["mlp", "cnn", "transformer"])
def test_models_sized_for_a_gpu_run_tiny(model):
    # Keras's attention has no float16 on JAX's CPU backend (see below).
    policy = "mixed_float16"
    if model == "transformer" and backends.JAX:
        policy = "mixed_bfloat16"
    results = bench.run_benchmark(
        [policy],
        ["fit", "custom"],
        steps=100,
        warmup_steps=1,
        native=False,
        torch_amp=False,
        model=model,
        size="tiny",
        verbose=False,
    )
    for r in results:
        assert (r["model"], r["size"]) == (model, "tiny")
        assert r["loss_scaling"] == (policy == "mixed_float16")
        assert 0.0 <= r["test_accuracy"] <= 1.0
    # Same weights, same first batch: the same first loss in both loops.
    fit, custom = results
    assert fit["losses"][0] == pytest.approx(custom["losses"][0], rel=1e-2)


@pytest.mark.jax
def test_transformer_in_float16_on_jax_cpu_is_refused_up_front():
    if bench.backend_module().device() != "cpu":
        pytest.skip("JAX runs on a GPU here")
    with pytest.raises(ValueError, match="needs a GPU"):
        bench.run_benchmark(
            ["float32", "mixed_float16"], model="transformer", size="tiny"
        )


def test_overhead_adds_rows_without_loss_scaling(mixed_float16_run):
    kmp_row, _, unscaled = mixed_float16_run
    assert unscaled["implementation"] == "unscaled"
    assert not unscaled["loss_scaling"] and unscaled["loss_scales"] is None
    assert kmp_row["loss_scaling_overhead"] == pytest.approx(
        kmp_row["median_ms"] / unscaled["median_ms"] - 1
    )
    header, _ = _tables(bench_report.format_table(mixed_float16_run))[0]
    assert bench_report.OVERHEAD_COLUMN in header
    assert "loss scaling adds to the mixed_float16 step: kmp" in (
        bench_report.summarize(mixed_float16_run)
    )


def test_memory_is_measured_where_the_backend_can(mixed_float16_run):
    for result in mixed_float16_run:
        if result["device"] == "cpu" and not backends.JAX:
            assert result["peak_memory_mb"] is None
        else:  # XLA's buffers of the compiled step, or a GPU's allocator.
            assert result["peak_memory_mb"] > 0


# --- Planning -----------------------------------------------------------------


def test_plan_configurations_orders_the_implementations():
    plan = bench.plan_configurations(
        ["float32", "mixed_float16"],
        ["fit", "custom"],
        native=True,
        overhead=True,
        torch_amp=True,
        device="gpu",
    )
    keras_side = [
        ("float32", "fit", "kmp"),
        ("float32", "custom", "kmp"),
        ("mixed_float16", "fit", "kmp"),
        ("mixed_float16", "custom", "kmp"),
        ("mixed_float16", "fit", "native"),
        ("mixed_float16", "custom", "native"),
        ("mixed_float16", "fit", "unscaled"),
        ("mixed_float16", "custom", "unscaled"),
    ]
    torch_side = [
        ("float32", "custom", "torch"),
        ("mixed_float16", "custom", "torch"),
        ("mixed_float16", "custom", "torch_unscaled"),
    ]
    assert plan == keras_side + (torch_side if backends.TORCH else [])


@pytest.mark.parametrize(
    "device, policies",
    [("gpu", ["mixed_bfloat16", "mixed_float16"]), ("cpu", ["mixed_bfloat16"])],
)
def test_plain_pytorch_amp_rows(device, policies):
    """No counterpart of the pure 16-bit policies; float16 on a GPU only."""
    plan = bench.plan_configurations(
        ["bfloat16", "float16", "mixed_bfloat16", "mixed_float16"],
        ["custom"],
        native=True,
        overhead=True,
        torch_amp=True,
        device=device,
    )
    torch_rows = [p for p in plan if p[2].startswith("torch")]
    expected = [(p, "custom", "torch") for p in policies]
    if "mixed_float16" in policies:
        expected.append(("mixed_float16", "custom", "torch_unscaled"))
    assert torch_rows == (expected if backends.TORCH else [])


@pytest.mark.parametrize(
    "seconds, step_seconds, rounds, expected",
    [
        (60.0, [0.01, 0.02, 0.03], 5, (995, True)),
        (60.0, [0.01, 0.02, 0.03], 10, (990, True)),
        (6.0, [0.1, 0.2, 0.3], 5, (100, False)),
        (1e6, [0.001], 5, (bench.MAX_BUDGET_STEPS, True)),
        (-3.0, [0.1], 5, (100, False)),
        (1.0, [0.0], 5, (bench.MAX_BUDGET_STEPS, True)),
    ],
    ids=[
        "five_rounds",
        "ten_rounds",
        "too_little_time_the_fewest_steps",
        "capped",
        "over_budget_the_fewest_steps",
        "no_time_measured",
    ],
)
def test_plan_steps(seconds, step_seconds, rounds, expected):
    assert bench.plan_steps(seconds, step_seconds, rounds) == expected


# --- Reporting, on made-up results ------------------------------------------


def _result(policy, loop, median_ms, accuracy, implementation="kmp"):
    scaled = policy == "mixed_float16" and implementation in (
        "kmp",
        "native",
        "torch",
    )
    return {
        "policy": policy,
        "loop": loop,
        "implementation": implementation,
        "loss_scaling": scaled,
        "backend": "tensorflow",
        "device": "cpu",
        "model": "digits",
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
        "kmp_over_torch": None,
        "loss_scaling_overhead": None,
        "peak_memory_mb": None,
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


def _torch_results():
    return _with_comparisons(
        [
            _result("float32", "custom", 10.0, 0.97),
            _result("mixed_bfloat16", "custom", 5.0, 0.97),
            _result("mixed_float16", "custom", 4.4, 0.97),
            _result("mixed_float16", "custom", 4.0, 0.97, "unscaled"),
            _result("float32", "custom", 8.0, 0.97, "torch"),
            _result("mixed_bfloat16", "custom", 5.0, 0.97, "torch"),
            _result("mixed_float16", "custom", 4.0, 0.97, "torch"),
            _result("mixed_float16", "custom", 3.2, 0.97, "torch_unscaled"),
        ]
    )


def test_pytorch_amp_rows_compare_with_their_own_float32():
    results = _torch_results()
    by_key = {(r["policy"], r["implementation"]): r for r in results}
    assert by_key[("mixed_bfloat16", "kmp")]["speedup_vs_float32"] == 2.0
    assert by_key[("mixed_bfloat16", "torch")]["speedup_vs_float32"] == 1.6
    assert by_key[("mixed_float16", "torch")]["kmp_over_torch"] == (
        pytest.approx(1.1)
    )
    assert by_key[("mixed_float16", "kmp")]["loss_scaling_overhead"] == (
        pytest.approx(0.1)
    )
    assert by_key[("mixed_float16", "torch")]["loss_scaling_overhead"] == (
        pytest.approx(0.25)
    )
    assert by_key[("mixed_float16", "unscaled")]["loss_scaling_overhead"] is (
        None
    )


def test_format_table_gives_pytorch_amp_its_own_table():
    tables = _tables(bench_report.format_table(_torch_results()))
    assert len(tables) == 3  # kmp, no loss scaling, PyTorch AMP.
    header, rows = tables[2]
    assert header[-1] == bench_report.TORCH_RATIO_COLUMN
    assert [r["policy"] for r in rows] == [
        "float32",
        "mixed_bfloat16",
        "mixed_float16",
        "mixed_float16, no GradScaler",
    ]
    assert [r[bench_report.OVERHEAD_COLUMN] for r in rows] == [
        "-",
        "-",
        "+25.0%",
        "-",
    ]
    assert rows[1]["kmp / PyTorch AMP"] == "1.00"


def test_summary_compares_kmp_with_pytorch_amp():
    summary = bench_report.summarize(_torch_results())
    assert (
        "custom loop: kmp's mixed_bfloat16 steps take as long as plain "
        "PyTorch AMP's (5.00 vs 5.00 ms/step); speed-up over float32: kmp "
        "2.00x, PyTorch AMP 1.60x." in summary
    )
    assert (
        "custom loop: loss scaling adds to the mixed_float16 step: kmp "
        "+10.0%, PyTorch's GradScaler +25.0%" in summary
    )


def test_float16_fusion_note_is_for_tensorflow_only():
    results = _with_comparisons([_result("mixed_float16", "fit", 4.0, 0.97)])
    assert bench_report.FLOAT16_FUSION_NOTE in bench_report.summarize(results)
    results[0]["backend"] = "jax"
    assert bench_report.FLOAT16_FUSION_NOTE not in (
        bench_report.summarize(results)
    )


@pytest.mark.parametrize(
    "keyword, value, error, fragment",
    [
        ("policies", ["float32", "int8"], ValueError, "must name only"),
        ("policies", "float32", TypeError, "must be a list of names"),
        ("loops", [], ValueError, "at least one"),
        ("steps", 0, ValueError, "'steps' must be an integer >= 1"),
        ("units", 2.5, TypeError, "'units' must be an integer"),
        ("rounds", 3, ValueError, "At least 5 rounds of 20 timed steps"),
        ("steps", 99, ValueError, "At least 5 rounds of 20 timed steps"),
        ("budget_seconds", 0, ValueError, "'budget_seconds' must be"),
        ("budget_seconds", "2", TypeError, "'budget_seconds' must be"),
        ("model", "resnet", ValueError, "'model' must be one of"),
        ("size", "huge", ValueError, "'size' must be one of"),
    ],
    ids=[
        "unknown_policy",
        "policies_string",
        "no_loops",
        "zero_steps",
        "float_units",
        "too_few_rounds",
        "too_few_steps",
        "zero_budget",
        "budget_string",
        "unknown_model",
        "unknown_size",
    ],
)
def test_run_benchmark_rejects_bad_arguments(keyword, value, error, fragment):
    arguments = {"steps": 100, "rounds": 5, "verbose": False, keyword: value}
    with pytest.raises(error, match=fragment):
        bench.run_benchmark(**arguments)


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


# --- Statistics in a run ------------------------------------------------------


# The bootstrap over the measured blocks: the same on every backend.
@pytest.mark.anybackend
def test_every_ratio_comes_with_an_interval():
    results = bench.run_benchmark(
        ["float32", "mixed_float16"],
        ["custom"],
        steps=100,
        warmup_steps=1,
        overhead=True,
        torch_amp=False,
        **TINY,
    )
    for r in results:
        assert r["rounds"] == 5 and r["steps"] == 100
        assert len(r["block_times_ms"]) == 5
        assert {len(blocks) for blocks in r["block_times_ms"]} == {4}
        low, high = r["speedup_vs_float32_ci"]
        assert low <= r["speedup_vs_float32"] <= high
    kmp_row = results[1]
    low, high = kmp_row["loss_scaling_overhead_ci"]
    assert low <= kmp_row["loss_scaling_overhead"] <= high
    # The same blocks give the same interval: the bootstrap is seeded.
    again = [dict(r) for r in results]
    bench.add_comparisons(again)
    assert again[2]["kmp_over_native_ci"] == results[2]["kmp_over_native_ci"]
    text = bench_report.format_table(results)
    (_, rows), *_ = _tables(text)
    for row in rows:
        assert "[" in row["speed-up vs float32"]
    assert "[95% interval] from a bootstrap over rounds and blocks" in text


def test_a_wide_interval_is_flagged():
    results = _with_comparisons(
        [
            _result("float32", "fit", 2.0, 0.97),
            _result("mixed_bfloat16", "fit", 1.0, 0.97),
        ]
    )
    results[1]["speedup_vs_float32_ci"] = [1.5, 2.5]
    (_, rows), *_ = _tables(bench_report.format_table(results))
    assert rows[1]["speed-up vs float32"] == "2.00 [1.50, 2.50] !"
    assert "(95% interval 1.50x to 2.50x, noisy)" in (
        bench_report.summarize(results)
    )
    results[1]["speedup_vs_float32_ci"] = [1.95, 2.1]
    (_, rows), *_ = _tables(bench_report.format_table(results))
    assert rows[1]["speed-up vs float32"] == "2.00 [1.95, 2.10]"


# The progress bars' printing: the same on every backend.
@pytest.mark.anybackend
def test_progress_into_a_file_prints_each_bar_once(capsys):
    # Not a terminal (pytest captures stdout): as Keras's fit, one line
    # per bar when it is done, not one per step.
    bench.run_benchmark(
        ["float32"],
        ["fit", "custom"],
        steps=100,
        warmup_steps=1,
        native=False,
        torch_amp=False,
        **dict(TINY, verbose=True),
    )
    output = capsys.readouterr().out
    steps = 2 * (100 + 5)
    assert output.count(f"/{steps}") == 1
    assert f"{steps}/{steps} - " in output
    assert output.count("2/2 - ") == 1  # The configurations' bar.
    assert "\r" not in output and "\b" not in output


# --- Low-precision state (--low-precision) ------------------------------------


def test_plan_adds_bfloat16_weights_with_16_and_8_bit_state():
    plan = bench.plan_configurations(
        ["float32"],
        ["fit", "custom"],
        native=False,
        overhead=False,
        torch_amp=False,
        low_precision=True,
    )
    assert plan == [
        ("float32", "fit", "kmp"),
        ("float32", "custom", "kmp"),
        ("bfloat16", "fit", "state16"),
        ("bfloat16", "custom", "state16"),
        ("bfloat16", "fit", "state8"),
        ("bfloat16", "custom", "state8"),
    ]


def test_low_precision_rows_train_and_report_their_state():
    # 64 units: the 64x64 kernel (4096 elements) gets 8-bit moments.
    results = bench.run_benchmark(
        ["float32"],
        ["custom"],
        steps=100,
        warmup_steps=1,
        native=False,
        torch_amp=False,
        low_precision=True,
        batch_size=8,
        units=64,
        verbose=False,
    )
    state = {r["implementation"]: r["state_mb"] for r in results}
    assert state["state8"] < state["state16"] < 0.6 * state["kmp"]
    for r in results:
        assert r["final_loss"] > 0 and r["speedup_vs_float32"] > 0
    text = bench_report.format_table(results)
    assert "with 16-bit and with 8-bit moments" in text
    header, rows = _tables(text)[-1]
    assert bench_report.STATE_COLUMN in header
    assert [row["policy"] for row in rows] == [
        "bfloat16, 16-bit state",
        "bfloat16, 8-bit state",
    ]


def test_every_step_runs_float32_at_full_precision(monkeypatch):
    """On a GPU JAX and TensorFlow compute float32 matmuls in TF32 by
    default (torch its cuDNN convolutions): the run pins full precision
    for every step, records it on every row and restores the settings."""
    module = backend_module()
    before = module.float32_matmuls()
    assert before != "float32"  # The frameworks' defaults allow TF32.
    seen = set()
    original = Configuration.step

    def step(self):
        seen.add(module.float32_matmuls())
        return original(self)

    monkeypatch.setattr(Configuration, "step", step)
    results = bench.run_benchmark(
        ["float32"], ["custom"], steps=100, warmup_steps=1, torch_amp=False,
        **TINY,
    )  # fmt: skip
    assert seen == {"float32"}
    assert [r["float32_matmuls"] for r in results] == ["float32"]
    assert module.float32_matmuls() == before


@pytest.mark.anybackend
def test_the_legend_says_the_float32_precision():
    results = [_result("float32", "fit", 10.0, 0.9)]
    # A result saved before kmp recorded it.
    legend = bench_report.legend(results)
    assert "the float32 layers' of the others): not recorded." in legend
    results[0]["float32_matmuls"] = "float32"
    legend = bench_report.legend(results)
    assert "others): float32 (full precision, TF32 off)." in legend
