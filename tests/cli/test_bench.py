"""Tests for `kmp bench` (kmp_cli/bench.py), at a tiny size, on every
backend; nothing is timed.

One in-process run of the whole command (every default policy and loop, the
native comparison, plain PyTorch AMP on torch, --json and --plot) is shared
by the tests that read its table, summary, JSON and plot.
"""

import contextlib
import functools
import importlib.util
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys

import keras
import pytest

import kmp_cli.bench
from kmp.tools.bench import models as bench_models
from kmp.tools.bench import report as bench_report
from kmp.tools.bench import run as bench
from kmp.tools.bench import stats as bench_stats
from kmp_cli import main
from tests.support import backends

# With -n: one worker runs this module: its whole-command run is built once.
pytestmark = pytest.mark.xdist_group("kmp_bench_run")

TINY = [
    "--steps",
    "100",
    "--rounds",
    "5",
    "--warmup",
    "2",
    "--units",
    "8",
    "--batch-size",
    "16",
]
# Every configuration's steps: its first call, --warmup more, one untimed
# step per round, then --steps timed ones.
STEPS_RUN = 1 + 2 + 5 + 100
KMP_ROWS = [
    (policy, loop)
    for policy in bench.DEFAULT_POLICIES
    for loop in bench_report.LOOPS
]
NATIVE_ROWS = [("mixed_float16", "fit"), ("mixed_float16", "custom")]
# Plain PyTorch AMP, on torch only (float16 on a GPU only).
_GPU = bench.backend_module().device() == "gpu"
TORCH_ROWS = (
    [
        (policy, "custom")
        for policy in bench.DEFAULT_POLICIES
        if _GPU or policy != "mixed_float16"
    ]
    if backends.TORCH
    else []
)
CONFIGURATIONS = len(KMP_ROWS) + len(NATIVE_ROWS) + len(TORCH_ROWS)
INSTALL_HINTS = {
    "tensorflow": "pip install 'kmp[cpu]'",
    "jax": "pip install 'kmp[jax]'",
    "torch": "pip install 'kmp[torch]'",
}


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


def _ratio_cell(cell):
    """'1.23 [1.10, 1.40] !' -> (1.23, 1.10, 1.40)."""
    value, interval = cell.rstrip(" !").split(" [")
    low, high = interval.rstrip("]").split(", ")
    return float(value), float(low), float(high)


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
    tables = _tables(full_run["output"])
    assert len(tables) == (3 if backends.TORCH else 2)
    assert tables[0][0] == list(bench_report.COLUMNS)
    assert tables[1][0] == list(bench_report.COLUMNS) + ["kmp / native"]
    if backends.TORCH:
        assert tables[2][0] == list(bench_report.COLUMNS) + [
            "kmp / PyTorch AMP"
        ]


def test_every_requested_configuration_has_a_row(full_run):
    tables = _tables(full_run["output"])
    rows = [[(r["policy"], r["loop"]) for r in t[1]] for t in tables]
    assert rows[0] == KMP_ROWS
    assert rows[1] == NATIVE_ROWS
    assert rows[2:] == ([TORCH_ROWS] if TORCH_ROWS else [])


def test_table_numbers_parse(full_run):
    tables = _tables(full_run["output"])
    for _, rows in tables:
        for row in rows:
            median, low, high = _median_cell(row["ms/step (median)"])
            assert 0 < low <= median <= high
            ratio, low, high = _ratio_cell(row["speed-up vs float32"])
            assert 0 < low <= ratio <= high
            assert float(row["samples/s"]) > 0
            assert math.isfinite(float(row["final loss"]))
            assert 0 <= float(row["test accuracy"].rstrip("%")) <= 100
            if row["policy"] == "mixed_float16":
                assert float(row["final loss scale"]) >= 1
                assert int(row["skipped steps"]) >= 0
            else:
                assert row["final loss scale"] == row["skipped steps"] == "-"
    for row in tables[1][1]:
        ratio, low, high = _ratio_cell(row["kmp / native"])
        assert 0 < low <= ratio <= high
    for row in tables[2][1] if backends.TORCH else []:
        ratio, low, high = _ratio_cell(row["kmp / PyTorch AMP"])
        assert 0 < low <= ratio <= high


def test_float32_speedup_is_one(full_run):
    tables = _tables(full_run["output"])
    float32 = [r for r in tables[0][1] if r["policy"] == "float32"]
    one = "1.00 [1.00, 1.00]"
    assert [r["speed-up vs float32"] for r in float32] == [one, one]
    if backends.TORCH:  # Against plain PyTorch's own float32.
        assert tables[2][1][0]["speed-up vs float32"] == one


def test_summary_compares_with_float32_and_native(full_run):
    output = full_run["output"]
    for loop in ("model.fit", "custom loop"):
        for policy in ("mixed_bfloat16", "mixed_float16"):
            assert f"{loop}: {policy} is " in output
        assert f"{loop}: kmp's mixed_float16 steps take" in output
    assert "accuracy" in output
    if backends.TORCH:
        assert "plain PyTorch AMP's" in output


def test_progress_is_shown_with_a_line_per_bar(full_run):
    output = full_run["output"]
    backend = keras.backend.backend()
    assert (
        "kmp bench: digits: 64-8-8-10 MLP on the digits, batch 16; Keras on "
        f"{backend}" in output
    )
    assert "Building, compiling and warming up every configuration..." in (
        output
    )
    assert "Compilation and warm-up (untimed, not in the budget): " in output
    assert "Timing 100 steps per configuration in 5 rounds of 4 blocks" in (
        output
    )
    # Not a terminal: Keras's progress bars print once, when done, as fit's
    # do in a log (not one update per step: thousands in a CI log).
    assert output.count(f"{CONFIGURATIONS}/{CONFIGURATIONS} - ") == 1
    steps = CONFIGURATIONS * (100 + 5)
    assert output.count(f"/{steps}") == 1
    assert f"{steps}/{steps} - " in output and "/step" in output
    assert "\r" not in output and "━" not in output
    assert "Time budget" not in output  # --steps fixes the steps.


def test_a_one_step_median_is_refused(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["bench", "--steps", "1", "--rounds", "5"])
    assert raised.value.code == 2
    assert "prints no median of fewer steps" in capsys.readouterr().err


# --- --json and --plot -------------------------------------------------------


def test_json_holds_machine_info_and_settings(full_run):
    document = full_run["json"]
    machine = document["machine"]
    assert machine["cpu_count"] == os.cpu_count()
    backend = keras.backend.backend()
    assert machine["backend"] == backend
    for key in (backend, "keras", "python", "kmp"):
        assert isinstance(machine[key], str) and machine[key]
    settings = document["settings"]
    assert settings["backend"] == backend
    assert settings["steps"] == 100 and settings["rounds"] == 5
    assert settings["blocks_per_round"] == 4
    assert settings["compile_and_warmup_seconds"] > 0
    assert settings["steps_fixed"] is True
    assert settings["policies"] == list(bench.DEFAULT_POLICIES)
    assert document["summary"] == bench_report.summarize(document["results"])


def test_json_names_its_date_and_command_for_the_performance_page(full_run):
    document = full_run["json"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", document["date"])
    assert document["command"].startswith("kmp bench ")
    assert "--json" in document["command"]


def test_json_holds_every_configuration_and_its_measurements(full_run):
    results = full_run["json"]["results"]
    configurations = [
        (r["policy"], r["loop"], r["implementation"]) for r in results
    ]
    assert configurations == [(p, loop, "kmp") for p, loop in KMP_ROWS] + [
        (p, loop, "native") for p, loop in NATIVE_ROWS
    ] + [(p, loop, "torch") for p, loop in TORCH_ROWS]
    for r in results:
        blocks = r["block_times_ms"]
        assert r["steps"] == 100 and r["rounds"] == len(blocks) == 5
        assert {len(round_) for round_ in blocks} == {4}
        times = [t for round_ in blocks for t in round_]
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
        side = "torch" if implementation == "torch" else "kmp"
        float32 = by_key[("float32", loop, side)]
        assert r["speedup_vs_float32"] == pytest.approx(
            float32["median_ms"] / r["median_ms"]
        )
        if implementation in ("native", "torch"):
            mine = by_key[(policy, loop, "kmp")]
            assert r[f"kmp_over_{implementation}"] == pytest.approx(
                mine["median_ms"] / r["median_ms"]
            )


def test_every_configuration_starts_alike(full_run):
    # Same initial weights and same first batch: the same first loss, from
    # fit's callback and from the custom loop alike (and from plain PyTorch
    # AMP's autocast, within 16-bit rounding).
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
    if backends.TORCH:  # The same network, float32 without autocast.
        assert by_key[("float32", "custom", "torch")]["losses"][0] == (
            pytest.approx(first, rel=1e-6)
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
            "--no-torch-amp",
            "--quiet",
        ]
    )
    assert code == 0
    assert "kmp bench:" not in output and "━" not in output
    ((header, rows),) = _tables(output)
    assert [(r["policy"], r["loop"]) for r in rows] == [("float32", "custom")]


def test_without_steps_the_run_follows_the_budget(tmp_path):
    path = tmp_path / "budget.json"
    code, output = _run_cli(
        [
            "bench",
            "--budget",
            "1",
            "--size",
            "tiny",
            "--policies",
            "float32",
            "--loops",
            "custom",
            "--no-native",
            "--no-torch-amp",
            "--warmup",
            "2",
            "--json",
            str(path),
        ]
    )
    assert code == 0
    assert "Time budget for the timed steps: 1 s (--budget)" in output
    assert "The budget (1 s) cannot hold 5 rounds of 20 timed steps" in (output)
    assert "Timing 100 steps per configuration in 5 rounds" in output
    document = json.loads(path.read_text())
    settings = document["settings"]
    assert settings["steps_fixed"] is False
    assert settings["budget_seconds"] == 1.0
    (result,) = document["results"]
    assert settings["steps"] == result["steps"] == 100
    assert result["rounds"] == 5


def test_a_gpu_model_with_the_loss_scaling_overhead_and_low_precision():
    code, output = _run_cli(
        [
            "bench",
            "--model",
            "cnn",
            "--size",
            "tiny",
            "--steps",
            "100",
            "--warmup",
            "1",
            "--policies",
            "mixed_float16",
            "--loops",
            "custom",
            "--overhead",
            "--low-precision",
            "--no-torch-amp",
            "--quiet",
        ]
    )
    assert code == 0
    tables = _tables(output)
    # kmp, native Keras 3, no loss scaling; bfloat16 weights with 16-bit
    # and 8-bit state.
    assert [len(rows) for _, rows in tables] == [1, 1, 1, 2]
    assert bench_report.STATE_COLUMN in tables[3][0]
    assert bench_report.OVERHEAD_COLUMN in tables[0][0]
    assert "model cnn, batch size 8" in output


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
        (["--rounds", "3"], "--rounds: must be at least 5"),
        (["--steps", "99"], "--steps: must be at least 100"),
        (["--budget", "0"], "--budget: must be a number of seconds > 0"),
        (["--budget", "soon"], "--budget: must be a number of seconds > 0"),
        (["--model", "resnet"], "--model: invalid choice: 'resnet'"),
        (["--size", "huge"], "--size: invalid choice: 'huge'"),
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
        "too_few_rounds",
        "too_few_steps",
        "zero_budget",
        "budget_not_a_number",
        "unknown_model",
        "unknown_size",
        "json_in_missing_directory",
        "json_is_a_directory",
        "plot_not_png",
        "unknown_option",
    ],
)
@pytest.mark.anybackend
def test_bad_arguments_are_usage_errors(arguments, fragment, tmp_path, capsys):
    arguments = [a.format(tmp=tmp_path) for a in arguments]
    with pytest.raises(SystemExit) as raised:
        main(["bench", *arguments])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: kmp")
    assert fragment in error


@pytest.mark.anybackend
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
    for option in ("--policies", "--model", "--budget", "--json", "--plot"):
        assert option in completed.stdout


@pytest.mark.anybackend
def test_the_command_line_defaults_are_run_benchmarks():
    assert kmp_cli.bench.DEFAULT_POLICIES == ",".join(bench.DEFAULT_POLICIES)
    assert kmp_cli.bench.LOOPS == bench_report.LOOPS
    assert kmp_cli.bench.MODELS == bench_models.MODELS
    assert kmp_cli.bench.SIZES == bench_models.SIZES
    for name in ("MODEL", "SIZE", "BUDGET_SECONDS", "ROUNDS", "WARMUP_STEPS"):
        assert getattr(kmp_cli.bench, f"DEFAULT_{name}") == getattr(
            bench, f"DEFAULT_{name}"
        )
    assert kmp_cli.bench.MIN_ROUNDS == bench_stats.MIN_ROUNDS
    assert kmp_cli.bench.MIN_ROUND_STEPS == bench_stats.MIN_ROUND_STEPS


# --- Which backend -----------------------------------------------------------


def _installed(backend):
    module = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}
    return importlib.util.find_spec(module[backend]) is not None


@pytest.mark.parametrize("backend", kmp_cli.bench.BACKENDS)
def test_a_backend_not_installed_is_one_line_naming_what_to_install(
    backend, capsys
):
    if _installed(backend):
        pytest.skip(f"{backend} is installed here")
    code = main(["bench", "--backend", backend, *TINY])
    assert code == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert error.startswith(f"kmp bench: the {backend} backend needs")
    assert INSTALL_HINTS[backend] in error
    assert "Traceback" not in error


def _fresh_python(code, environment):
    environment = dict(environment, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )


def _choice(environment):
    completed = _fresh_python(
        "import sys, kmp_cli.bench as b\n"
        "print(b.choose_backend())\n"
        "assert 'keras' not in sys.modules, 'keras imported'\n",
        environment,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout.strip()


def test_without_backend_kmp_bench_picks_an_installed_one(tmp_path):
    this = keras.backend.backend()
    others = [b for b in kmp_cli.bench.BACKENDS if not _installed(b)]
    environment = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    environment["KERAS_HOME"] = str(tmp_path)
    first_installed = next(b for b in kmp_cli.bench.BACKENDS if _installed(b))
    # No keras.json: the first installed of tensorflow, jax, torch.
    assert _choice(environment) == first_installed
    # keras.json names this backend: it.
    (tmp_path / "keras.json").write_text(json.dumps({"backend": this}))
    assert _choice(environment) == this
    # keras.json names one not installed (Keras writes "tensorflow" there by
    # default, also in a JAX-only environment): an installed one instead.
    if others:
        (tmp_path / "keras.json").write_text(json.dumps({"backend": others[0]}))
        assert _choice(environment) == first_installed
    # KERAS_BACKEND decides when set.
    assert _choice(dict(environment, KERAS_BACKEND=this)) == this


@functools.lru_cache(maxsize=None)
def _fresh_custom_loop_run():
    """A tiny loss-scaled custom-loop run of `kmp bench` in a fresh process,
    `--backend` naming this backend and `KERAS_BACKEND` another, Keras
    imported only after it (once for the module: both tests below read it)."""
    this = keras.backend.backend()
    other = "torch" if this != "torch" else "jax"
    code = (
        "import sys, kmp_cli\n"
        f"code = kmp_cli.main(['bench', '--backend', {this!r}, "
        "'--policies', 'mixed_float16', '--loops', 'custom', '--no-native', "
        "'--no-torch-amp', '--steps', '100', '--warmup', '1', "
        "'--units', '4', '--batch-size', '8', '--quiet'])\n"
        "import keras\n"
        "print('ran on', keras.backend.backend())\n"
        "sys.exit(code)\n"
    )
    return _fresh_python(code, dict(os.environ, KERAS_BACKEND=other))


def test_backend_is_used_before_keras_is_imported():
    # KERAS_BACKEND names another backend, but Keras is not imported yet:
    # --backend sets it, in this same process.
    completed = _fresh_custom_loop_run()
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "| mixed_float16 | custom |" in completed.stdout
    assert f"ran on {keras.backend.backend()}" in completed.stdout


@pytest.mark.tensorflow
def test_no_autograph_warning_in_a_fresh_process():
    # AutoGraph converts what a tf.function calls, and warns once a process
    # about what it cannot convert (kmp's loss-scaled custom step once reached
    # importlib's `_gcd_import`): a fresh process, TensorFlow's Python
    # logging left on (TF_CPP_MIN_LOG_LEVEL hides only its C++ logs). The
    # custom loop only: fit's train function is Keras's, which AutoGraph
    # leaves as it is, and with it what it calls.
    completed = _fresh_custom_loop_run()
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    assert "| mixed_float16 | custom |" in completed.stdout
    assert "AutoGraph could not transform" not in output, output[-3000:]


def test_backend_other_than_keras_here_runs_in_a_new_process(monkeypatch):
    calls = []
    monkeypatch.setattr(
        kmp_cli.bench,
        "_run_elsewhere",
        lambda args, backend: calls.append((backend, args.argv)) or 0,
    )
    this = keras.backend.backend()
    monkeypatch.setattr(keras.backend, "backend", lambda: "elsewhere")
    argv = ["bench", "--backend", this, *TINY]
    assert main(argv) == 0
    assert calls == [(this, argv)]
