"""Tests for `kmp bench` (kmp_cli/bench.py), at a tiny size; nothing is timed.

One in-process run of the whole command (every default policy and loop, the
native comparison, --json and --plot) is shared by the tests that read its
table, summary, JSON and plot.
"""

import contextlib
import io
import json
import math
import os
import statistics
import subprocess
import sys

import pytest

import kmp_cli.bench
from kmp.tools import bench
from kmp.tools import bench_report
from kmp_cli import main

TINY = [
    "--steps",
    "4",
    "--rounds",
    "2",
    "--warmup",
    "2",
    "--units",
    "8",
    "--batch-size",
    "16",
]
# Every configuration's steps: its first call, --warmup more, one untimed
# step per round, then --steps timed ones.
STEPS_RUN = 1 + 2 + 2 + 4
KMP_ROWS = [
    (policy, loop)
    for policy in bench.DEFAULT_POLICIES
    for loop in bench_report.LOOPS
]
NATIVE_ROWS = [("mixed_float16", "fit"), ("mixed_float16", "custom")]


def _run_cli(argv):
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        code = main(argv)
    return code, output.getvalue()


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


def _median_cell(cell):
    """'1.23 (1.10-1.40)' -> (1.23, 1.10, 1.40)."""
    median, spread = cell.split(" (")
    low, high = spread.rstrip(")").split("-")
    return float(median), float(low), float(high)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench")
    json_path = directory / "results.json"
    plot_path = directory / "results.png"
    code, output = _run_cli(
        ["bench", *TINY, "--json", str(json_path), "--plot", str(plot_path)]
    )
    with open(json_path, encoding="utf-8") as file:
        document = json.load(file)
    return {
        "code": code,
        "output": output,
        "json": document,
        "plot_path": plot_path,
    }


# --- The command's output ----------------------------------------------------


def test_full_run_exits_zero(full_run):
    assert full_run["code"] == 0


def test_tables_have_the_documented_columns(full_run):
    (kmp_header, _), (native_header, _) = _tables(full_run["output"])
    assert kmp_header == list(bench_report.COLUMNS)
    assert native_header == list(bench_report.COLUMNS) + ["kmp / native"]


def test_every_requested_configuration_has_a_row(full_run):
    (_, kmp_rows), (_, native_rows) = _tables(full_run["output"])
    assert [(r["policy"], r["loop"]) for r in kmp_rows] == KMP_ROWS
    assert [(r["policy"], r["loop"]) for r in native_rows] == NATIVE_ROWS


def test_table_numbers_parse(full_run):
    (_, kmp_rows), (_, native_rows) = _tables(full_run["output"])
    for row in kmp_rows + native_rows:
        median, low, high = _median_cell(row["ms/step (median)"])
        assert 0 < low <= median <= high
        assert float(row["speed-up vs float32"]) > 0
        assert float(row["samples/s"]) > 0
        assert math.isfinite(float(row["final loss"]))
        assert 0 <= float(row["test accuracy"].rstrip("%")) <= 100
        if row["policy"] == "mixed_float16":
            assert float(row["final loss scale"]) >= 1
            assert int(row["skipped steps"]) >= 0
        else:
            assert row["final loss scale"] == row["skipped steps"] == "-"
    for row in native_rows:
        assert float(row["kmp / native"]) > 0


def test_float32_speedup_is_one(full_run):
    (_, kmp_rows), _ = _tables(full_run["output"])
    float32 = [r for r in kmp_rows if r["policy"] == "float32"]
    assert [r["speed-up vs float32"] for r in float32] == ["1.00", "1.00"]


def test_summary_compares_with_float32_and_native(full_run):
    output = full_run["output"]
    for loop in ("model.fit", "custom loop"):
        for policy in ("mixed_bfloat16", "mixed_float16"):
            assert f"{loop}: {policy} is " in output
        assert f"{loop}: kmp's mixed_float16 steps take" in output
    assert "accuracy" in output


def test_progress_is_shown_for_both_loops(full_run):
    output = full_run["output"]
    assert "Building and warming up 8 configurations" in output
    assert "round 2/2, 2 steps: float32 / model.fit / kmp" in output
    assert "round 2/2, 2 steps: mixed_float16 / custom loop / native" in output
    assert output.count("  warmed up ") == 8
    assert "warmed up float32 / custom loop / kmp: first call" in output


# --- --json and --plot -------------------------------------------------------


def test_json_holds_machine_info_and_settings(full_run):
    document = full_run["json"]
    machine = document["machine"]
    assert machine["cpu_count"] == os.cpu_count()
    for key in ("tensorflow", "keras", "python", "kmp"):
        assert isinstance(machine[key], str) and machine[key]
    settings = document["settings"]
    assert settings["steps"] == 4 and settings["rounds"] == 2
    assert settings["policies"] == list(bench.DEFAULT_POLICIES)
    assert document["summary"] == bench_report.summarize(document["results"])


def test_json_holds_every_configuration_and_its_measurements(full_run):
    results = full_run["json"]["results"]
    configurations = [
        (r["policy"], r["loop"], r["implementation"]) for r in results
    ]
    assert configurations == [(p, loop, "kmp") for p, loop in KMP_ROWS] + [
        (p, loop, "native") for p, loop in NATIVE_ROWS
    ]
    for r in results:
        times = r["step_times_ms"]
        assert len(times) == r["steps"] == 4
        assert r["median_ms"] == pytest.approx(statistics.median(times))
        assert r["min_ms"] <= r["q1_ms"] <= r["median_ms"] <= r["q3_ms"]
        assert r["q3_ms"] <= r["max_ms"]
        assert len(r["losses"]) == STEPS_RUN
        assert r["warmup_steps"] == 2
        assert math.isfinite(r["final_loss"])
        assert 0.0 <= r["test_accuracy"] <= 1.0
        if r["loss_scaling"]:
            assert len(r["loss_scales"]) == STEPS_RUN
            assert r["final_loss_scale"] == r["loss_scales"][-1]
            assert isinstance(r["skipped_steps"], int)
        else:
            assert r["loss_scales"] is None
            assert r["final_loss_scale"] is None
            assert r["skipped_steps"] is None


def test_json_ratios_match_the_medians(full_run):
    results = full_run["json"]["results"]
    by_key = {(r["policy"], r["loop"], r["implementation"]): r for r in results}
    for (policy, loop, implementation), r in by_key.items():
        float32 = by_key[("float32", loop, "kmp")]
        assert r["speedup_vs_float32"] == pytest.approx(
            float32["median_ms"] / r["median_ms"]
        )
        if implementation == "native":
            mine = by_key[(policy, loop, "kmp")]
            assert r["kmp_over_native"] == pytest.approx(
                mine["median_ms"] / r["median_ms"]
            )


def test_every_configuration_starts_alike(full_run):
    # Same initial weights and same first batch: the same first loss, from
    # fit's callback and from the custom loop alike.
    by_key = {
        (r["policy"], r["loop"], r["implementation"]): r
        for r in full_run["json"]["results"]
    }
    first = by_key[("float32", "custom", "kmp")]["losses"][0]
    for r in by_key.values():
        assert r["losses"][0] == pytest.approx(first, rel=1e-2)
    assert by_key[("float32", "fit", "kmp")]["losses"][0] == pytest.approx(
        first, rel=1e-6
    )


def test_fit_losses_are_per_step_like_the_custom_loop(full_run):
    # fit logs a running mean; the per-step losses recovered from it follow
    # the custom loop's, which trains the same model on the same batches.
    by_key = {
        (r["policy"], r["loop"]): r["losses"]
        for r in full_run["json"]["results"]
        if r["implementation"] == "kmp"
    }
    assert by_key[("float32", "fit")] == pytest.approx(
        by_key[("float32", "custom")], rel=1e-3
    )


def test_plot_is_a_png(full_run):
    data = full_run["plot_path"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


# --- Smaller runs ------------------------------------------------------------


def test_quiet_prints_only_results():
    code, output = _run_cli(
        [
            "bench",
            *TINY,
            "--policies",
            "float32",
            "--loops",
            "custom",
            "--no-native",
            "--quiet",
        ]
    )
    assert code == 0
    assert "round " not in output and "━" not in output
    ((header, rows),) = _tables(output)
    assert [(r["policy"], r["loop"]) for r in rows] == [("float32", "custom")]


# --- Bad arguments -----------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        (["--policies", "float32,mixed_int8"], "unknown policy 'mixed_int8'"),
        (["--policies", "float32,float32"], "listed twice"),
        (["--loops", "fit,eager"], "unknown loop 'eager'"),
        (["--steps", "0"], "--steps: must be a positive integer"),
        (["--steps", "ten"], "--steps: must be a positive integer"),
        (["--batch-size", "-4"], "--batch-size: must be a positive integer"),
        (["--units", "0"], "--units: must be a positive integer"),
        (["--steps", "2", "--rounds", "3"], "--rounds: must be at most"),
        (["--json", "{tmp}/missing/out.json"], "does not exist"),
        (["--json", "{tmp}"], "is a directory"),
        (["--plot", "{tmp}/out.jpg"], "must be a .png file name"),
        (["--fast"], "unrecognized arguments: --fast"),
    ],
    ids=[
        "unknown_policy",
        "repeated_policy",
        "unknown_loop",
        "zero_steps",
        "non_integer_steps",
        "negative_batch_size",
        "zero_units",
        "more_rounds_than_steps",
        "json_in_missing_directory",
        "json_is_a_directory",
        "plot_not_png",
        "unknown_option",
    ],
)
def test_bad_arguments_are_usage_errors(arguments, fragment, tmp_path, capsys):
    arguments = [a.format(tmp=tmp_path) for a in arguments]
    with pytest.raises(SystemExit) as raised:
        main(["bench", *arguments])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: kmp")
    assert fragment in error


def test_help_through_python_dash_m():
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    completed = subprocess.run(
        [sys.executable, "-m", "kmp", "bench", "--help"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("usage: kmp bench")
    for option in ("--policies", "--loops", "--steps", "--json", "--plot"):
        assert option in completed.stdout


def test_the_command_line_defaults_are_run_benchmarks():
    assert kmp_cli.bench.DEFAULT_POLICIES == ",".join(bench.DEFAULT_POLICIES)
    assert kmp_cli.bench.LOOPS == bench_report.LOOPS
    for name in ("STEPS", "BATCH_SIZE", "UNITS", "ROUNDS", "WARMUP_STEPS"):
        assert getattr(kmp_cli.bench, f"DEFAULT_{name}") == getattr(
            bench, f"DEFAULT_{name}"
        )


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_other_backends_are_not_supported_yet(backend, capsys):
    with pytest.raises(SystemExit) as raised:
        main(["bench", *TINY, "--backend", backend])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert f"--backend: {backend} is not supported yet" in error
    assert "tf.GradientTape" in error and "--backend tensorflow" in error


def _python(code, backend):
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    environment["KERAS_BACKEND"] = backend
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )


def test_backend_runs_the_bench_in_a_process_on_that_backend():
    # This process is on "jax" (not even installed here): kmp bench must not
    # import Keras here, and runs itself again on TensorFlow.
    code = (
        "import sys, kmp_cli\n"
        "code = kmp_cli.main(['bench', '--backend', 'tensorflow', "
        "'--policies', 'float32', '--loops', 'custom', '--no-native', "
        "'--steps', '1', '--rounds', '1', '--warmup', '1', '--units', '4', "
        "'--batch-size', '8', '--quiet'])\n"
        "assert 'keras' not in sys.modules, 'keras imported'\n"
        "sys.exit(code)\n"
    )
    completed = _python(code, "jax")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "| float32 | custom |" in completed.stdout


def test_keras_on_another_backend_is_told_to_pass_backend(monkeypatch, capsys):
    import keras

    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(SystemExit) as raised:
        main(["bench", *TINY])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert "Keras runs on 'jax' here, which kmp bench does not support" in (
        error
    )
    assert "Use --backend tensorflow." in error
