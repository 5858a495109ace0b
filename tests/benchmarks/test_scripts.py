"""Every script under `benchmarks/` runs end to end in a tiny mode.

Each entry of `SMOKE` runs `python benchmarks/<script> <args>` as a fresh
interpreter would (`tests.support.warm`; cwd a temporary directory) and
checks its exit code and a text it must print; a script's name is its path
under `benchmarks/` (`diagnostics/op_profile.py`). Numbers from these runs
mean nothing; the point is that a script whose imports or options rot fails
here. A new script fails `test_table_covers_every_script` until it has its
entry, and a new diagnostic until `benchmarks/diagnostics/README.md` lists
it. (The GPU runner, `benchmarks/gpu/`, has its own tiny runs in
`test_gpu_runner.py`.)
"""

import argparse
import functools
import json
import os
import pathlib
import sys

import keras
import pytest

from tests.support import warm

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

# script -> (arguments, text its output must contain); "{tmp}" in an
# argument is the test's temporary directory.
SMOKE = {
    "diagnostics/bf16_breakdown.py": (["--quick"], "no-update"),
    "bf16_speedup.py": (
        "--quick --models mlp --results {tmp}/bf16_speedup.json".split(),
        ">= 1.7x",
    ),
    "loss_scale_overhead.py": (
        "--quick --models mlp --results {tmp}/loss_scale_overhead.json".split(),
        "<= +3%",
    ),
    "diagnostics/lstm_graph.py": (
        [],
        "Training step (forward and gradient)",
    ),
    "diagnostics/overhead_breakdown.py": (
        "--layers 2 --units 16 --rounds 1 --steps 2 --warmup 1"
        " --variants plain,kmp".split(),
        "Adam alone",
    ),
    "step_costs_summary.py": (["--output", "{tmp}/step_costs.json"], "Wrote"),
    "bf16_all_the_way.py": (
        "--quick --tasks digits --plot {tmp}/curves.png"
        " --results {tmp}/bf16_all_the_way.json".split(),
        "loss curves written",
    ),
    "memory.py": (
        "--quick --models mlp --results {tmp}/memory.json".split(),
        "memory beyond the weights",
    ),
    "memory_breakdown.py": (
        "--quick --models mlp --variants keras"
        " --results {tmp}/memory_breakdown.json".split(),
        "the benchmark as it is",
    ),
    "diagnostics/memory_keras_vs_raw.py": (["--quick"], "bf16 / float32"),
    "diagnostics/op_profile.py": (["--quick"], "ReadVariableOp"),
}

# Scripts that run on every backend (here on the one the suite runs on).
EVERY_BACKEND = {
    "eight_bit.py": (
        "--quick --models language --seeds 1 --no-memory --no-torchao"
        " --output {tmp}/eight_bit.json".split()
        + ["--configurations", "float32,bf16 + 4-bit state"],
        "bf16 + 4-bit state",
    ),
    "low_bit_update.py": (
        "--quick --rounds 1 --steps 1 --configurations float32,8bit,4bit"
        " --output {tmp}/low_bit_update.json"
        " --results {tmp}/results/low_bit_update.json".split(),
        "The update alone",
    ),
    "low_bit_memory.py": (
        ["--quick", "--models", "mlp"]
        + ["--configurations", "floor,bf16 AdamW,8bit"]
        + "--output {tmp}/low_bit_memory.json"
        " --results {tmp}/results/low_bit_memory.json".split(),
        "beyond the floor",
    ),
    "step_costs.py": (
        "--sizes 4 --steps 1 --time-steps 2 --time-repeats 1 --loops loop"
        " --output {tmp}/step_costs.json".split(),
        "kmp's call sites",
    ),
}

# The file each writes, and what its records must hold.
OUTPUTS = {
    "eight_bit.py": "eight_bit.json",
    "low_bit_update.py": "low_bit_update.json",
    "low_bit_memory.py": "low_bit_memory.json",
    "step_costs.py": "step_costs.json",
}
EXPECTED = {
    "eight_bit.py": {"float32", "bf16 + 4-bit state"},
    "low_bit_update.py": {"float32", "8bit", "4bit"},
    "low_bit_memory.py": {"floor", "bf16 AdamW", "8bit"},
    "step_costs.py": {"plain", "kmp"},
}

# Scripts for one backend: the mark that skips them elsewhere, and the
# KERAS_BACKEND their subprocess gets.
JAX_ONLY = {
    "diagnostics/low_bit_look.py": (
        "--quick --output {tmp}/low_bit_look.json".split(),
        "held-out loss",
    ),
    "jax_overhead.py": (
        "--quick --models mlp --results {tmp}/jax_overhead.json".split(),
        "bfloat16 speed-up",
    ),
    "jax_step_memory.py": (
        "--quick --configurations float32,8bit"
        " --results {tmp}/jax_step_memory.json".split(),
        "temporaries",
    ),
    "diagnostics/jax_apply_or_skip.py": (
        "--variables 4 --repeats 1 --steps 2".split(),
        "kmp (cond)",
    ),
    "shard_state.py": (
        "--quick --devices 4 --results {tmp}/shard_state.json".split(),
        "state bytes/device, split / replicated",
    ),
}

# The result file each claim script writes with --results (the
# performance page's format), under the test's temporary directory.
RESULTS = {
    "bf16_all_the_way.py": "bf16_all_the_way.json",
    "bf16_speedup.py": "bf16_speedup.json",
    "jax_overhead.py": "jax_overhead.json",
    "jax_step_memory.py": "jax_step_memory.json",
    "loss_scale_overhead.py": "loss_scale_overhead.json",
    "low_bit_update.py": "results/low_bit_update.json",
    "low_bit_memory.py": "results/low_bit_memory.json",
    "memory.py": "memory.json",
    "memory_breakdown.py": "memory_breakdown.json",
    "step_costs_summary.py": "step_costs.json",
}

# Scripts that need keras-hub (skipped without it), on every backend.
HUB = {
    "hub_convert.py": (
        "--steps 2 --batch-size 4 --files 1".split(),
        "converted / hand-built",
    ),
}

# Libraries imported by the scripts: they only need to import.
LIBRARIES = {
    "common.py",
    "language_task.py",
    "report.py",
    "torch_update_timing.py",
}


def _run(args, cwd, extra_env=None):
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ in benchmarks/
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra_env or {})
    return warm.run(args, env=env, cwd=cwd, timeout=300)


def _scripts():
    """Every script, by its path under `benchmarks/`."""
    paths = [*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("diagnostics/*.py")]
    return {path.relative_to(BENCHMARKS).as_posix() for path in paths}


def test_table_covers_every_script():
    scripts = _scripts()
    listed = set(SMOKE) | set(EVERY_BACKEND) | set(JAX_ONLY) | set(HUB)
    listed |= LIBRARIES
    assert scripts == listed


def test_the_diagnostics_readme_lists_every_diagnostic():
    readme = (BENCHMARKS / "diagnostics" / "README.md").read_text()
    listed = {
        "diagnostics/" + line.split("`")[1]
        for line in readme.splitlines()
        if line.startswith("| `")
    }
    assert listed == {s for s in _scripts() if s.startswith("diagnostics/")}


def _repository_files():
    """`benchmarks/`'s files and their times, less Python's bytecode caches
    (written by any test process that imports a benchmark module)."""
    return sorted(
        (str(p), p.stat().st_mtime_ns)
        for p in BENCHMARKS.rglob("*")
        if "__pycache__" not in p.parts
    )


def _smoke(name, args, expected, tmp_path, extra_env=None):
    before = _repository_files()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = _run([str(BENCHMARKS / name), *args], tmp_path, extra_env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert expected in result.stdout, result.stdout[-3000:]
    assert _repository_files() == before, "wrote into benchmarks/"
    if name in RESULTS:
        _check_results_file(tmp_path / RESULTS[name], name)
    return result


def _perf_results():
    """docs/_ext/perf_results.py, the performance page's renderer."""
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    import perf_results

    return perf_results


def _check_results_file(path, name):
    """The file loads and renders as the page would, naming `name`."""
    perf_results = _perf_results()
    document = perf_results.load(path)
    assert perf_results.writer(path, document) == f"benchmarks/{name}"
    rows = [r for t in document["tables"] for r in t["measurements"]]
    assert rows
    assert len(perf_results.figures(document)) == len(document["tables"])
    if name == "step_costs_summary.py":  # Gathers step_costs.py's files.
        return
    assert all(r["command"] in document["commands"] for r in rows)
    for command in document["commands"].values():
        assert f"benchmarks/{name}" in command and "--results" not in command


@pytest.mark.tensorflow
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_script_runs_in_tiny_mode(name, tmp_path):
    args, expected = SMOKE[name]
    _smoke(name, args, expected, tmp_path)
    if name == "step_costs_summary.py":
        document = json.loads((tmp_path / "step_costs.json").read_text())
        assert document["format"] == "kmp-benchmark-results/1"


@pytest.mark.anybackend  # Reads files written before: no backend.
def test_eight_bit_summary_writes_the_pages_file(tmp_path):
    args = ["--summary", "--output", str(tmp_path / "eight_bit.json")]
    result = _run([str(BENCHMARKS / "eight_bit.py"), *args], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    perf_results = _perf_results()
    path = tmp_path / "eight_bit.json"
    document = perf_results.load(path)
    assert perf_results.writer(path, document) == "benchmarks/eight_bit.py"
    page_file = perf_results.RESULTS / "eight_bit.json"
    assert document == json.loads(page_file.read_text())


@pytest.mark.anybackend  # Files and arguments only.
def test_results_replace_what_a_run_measured_and_keep_the_rest(
    monkeypatch, tmp_path
):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import report

    def table(*rows):
        return {
            "caption": "ratio",
            "unit": "x",
            "measurements": [
                {"group": group, "series": series, "value": value}
                for group, series, value in rows
            ],
        }

    path = tmp_path / "x.json"
    write = functools.partial(
        report.write_results,
        path,
        script="benchmarks/memory.py",
        title="t",
        about="a",
    )
    monkeypatch.setattr(sys, "argv", ["memory.py", "--models", "mlp"])
    write(tables=[table(("mlp", "kmp", 1.0), ("cnn", "kmp", 2.0))])
    monkeypatch.setattr(sys, "argv", ["memory.py", "--models", "cnn"])
    write(tables=[table(("cnn", "kmp", 3.0), ("cnn", "keras", 4.0))])
    document = json.loads(path.read_text())
    rows = document["tables"][0]["measurements"]
    assert [(r["group"], r["series"], r["value"]) for r in rows] == [
        ("mlp", "kmp", 1.0),
        ("cnn", "kmp", 3.0),
        ("cnn", "keras", 4.0),
    ]
    (first, second) = document["commands"]
    assert rows[0]["command"] == first and rows[1]["command"] == second
    assert document["commands"][second].endswith("memory.py --models cnn")

    # --quick numbers never go to the page's own file.
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    report.add_results_argument(parser, "memory.json")
    args = parser.parse_args(["--results"])
    assert report.results_path(parser, args, "memory.json") == (
        BENCHMARKS / "results" / "memory.json"
    )
    with pytest.raises(SystemExit):
        report.results_path(
            parser, parser.parse_args(["--quick", "--results"]), "memory.json"
        )
    args = parser.parse_args(["--quick", "--results", str(path)])
    assert report.results_path(parser, args, "memory.json") == path


@pytest.mark.parametrize("name", sorted(EVERY_BACKEND))
def test_script_runs_on_this_backend(name, tmp_path):
    args, expected = EVERY_BACKEND[name]
    backend = {"KERAS_BACKEND": keras.backend.backend()}
    _smoke(name, args, expected, tmp_path, backend)
    document = json.loads((tmp_path / OUTPUTS[name]).read_text())
    assert document["backend"] == backend["KERAS_BACKEND"]
    kind = {"step_costs.py": "optimizer"}.get(name, "configuration")
    assert {r[kind] for r in document["records"]} >= EXPECTED[name]
    if name == "step_costs.py":
        # Timed (--time-steps 2): kmp's row carries its goal.
        (kmp_row,) = [r for r in document["records"] if r["optimizer"] == "kmp"]
        assert kmp_row["goal"].startswith("<= ")
        assert isinstance(kmp_row["goal_met"], bool)
        # Counted where XLA compiles the update: plain Adam reads each
        # gradient twice, kmp no more often than Keras's LossScaleOptimizer.
        passes = {
            r["optimizer"]: r["passes_per_gradient"]
            for r in document["records"]
        }
        if backend["KERAS_BACKEND"] == "torch":
            assert passes["plain"] is None
        else:
            assert passes["plain"] == [2, 2]
            assert passes["kmp"][1] <= passes["keras"][0]
    if name == "eight_bit.py":
        language = [r for r in document["records"] if r["model"] == "language"]
        assert language and all(r["floor"] > 1.8 for r in language)
    if name == "low_bit_update.py":
        ratios = {r["configuration"]: r["ratio"] for r in document["records"]}
        assert ratios["float32"] == 1.0
        passes = {
            r["configuration"]: r["passes_largest_gradient"]
            for r in document["records"]
        }
        # Counted on JAX only: float32 Adam reads a gradient twice.
        expected = 2 if backend["KERAS_BACKEND"] == "jax" else None
        assert passes["float32"] == expected


@pytest.mark.tensorflow  # Arithmetic on records: the same on every backend.
def test_step_costs_sets_each_goal_against_its_bound(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import step_costs

    def row(kind, loop, ratio):
        return {
            "optimizer": kind,
            "loop": loop,
            "variables": 202,
            "time_ratio": ratio,
        }

    records = [
        row("plain", "loop", 1.0),
        row("kmp", "loop", 1.04),
        row("keras", "loop", 1.2),
        row("kmp", "fit", 1.5),
        row("kmp", "fit-xla", 1.06),
    ]
    step_costs.add_goals("tensorflow", records)
    goals = [(r.get("goal"), r.get("goal_met")) for r in records]
    assert goals == [
        (None, None),
        ("<= 1.05x", True),
        (None, None),
        (None, None),
        ("<= 1.05x", False),
    ]
    torch_records = [
        row("kmp", "loop", 1.02),
        row("gradscaler", "loop", 1.03),
        row("kmp-fused", "loop", 0.99),
        row("gradscaler-fused", "loop", 0.98),
    ]
    step_costs.add_goals("torch", torch_records)
    assert [(r.get("goal"), r.get("goal_met")) for r in torch_records] == [
        ("<= gradscaler's 1.03x", True),
        (None, None),
        ("<= gradscaler-fused's 0.98x", False),
        (None, None),
    ]
    jax_records = [
        row("kmp", "loop", 1.04),
        row("keras", "loop", 1.03),
        row("kmp", "fit", 1.3),
    ]
    step_costs.add_goals("jax", jax_records)
    assert [(r.get("goal"), r.get("goal_met")) for r in jax_records] == [
        ("<= 1.05x and <= keras's 1.03x", False),
        (None, None),
        (None, None),
    ]


@pytest.mark.tensorflow  # The argument checks: the same on every backend.
def test_low_bit_update_refuses_what_it_cannot_measure(monkeypatch, capsys):
    # In this process: the checks come before anything is measured.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import low_bit_update

    measured = []
    monkeypatch.setattr(low_bit_update, "measure", measured.append)
    for args, message in (
        (["--configurations", "float32,2bit"], "unknown configurations"),
        (["--rounds", "0"], "--rounds and --steps must be at least 1"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            low_bit_update.main(args)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert not measured


@pytest.mark.tensorflow  # One backend: the children's code is the MLP's.
def test_eight_bit_measures_an_embedding_models_peak(tmp_path):
    """`--embedding-memory`: a process of its own per configuration, on an
    embedding classifier (a sparse gradient on TensorFlow), added to the
    output file beside what it held."""
    output = tmp_path / "eight_bit.json"
    output.write_text(json.dumps({"backend": "tensorflow", "kept": 1}))
    args = ["--embedding-memory", "--quick", "--output", str(output)]
    args += ["--configurations", "bf16 + 8-bit state"]
    _smoke("eight_bit.py", args, "embedding memory", tmp_path)
    document = json.loads(output.read_text())
    assert document["kept"] == 1
    (row,) = document["embedding_memory"]
    assert row["model"] == "embedding"
    assert row["configuration"] == "bf16 + 8-bit state"
    assert row["state_mb"] > 0 and row["peak_mb"] > 0
    bad = _run(
        [str(BENCHMARKS / "eight_bit.py"), "--embedding-memory", "--quick"]
        + ["--configurations", "bf16 + 2-bit state", "--output", str(output)],
        tmp_path,
    )
    assert bad.returncode != 0
    assert "unknown ['bf16 + 2-bit state']" in bad.stderr
    assert json.loads(output.read_text()) == document  # Nothing written.


@pytest.mark.jax
@pytest.mark.parametrize("name", sorted(JAX_ONLY))
def test_jax_script_runs_in_tiny_mode(name, tmp_path):
    args, expected = JAX_ONLY[name]
    _smoke(name, args, expected, tmp_path, {"KERAS_BACKEND": "jax"})


@pytest.mark.parametrize("name", sorted(HUB))
def test_hub_script_runs_on_this_backend(name, tmp_path):
    pytest.importorskip("keras_hub", reason="keras-hub is not installed")
    args, expected = HUB[name]
    backend = {"KERAS_BACKEND": keras.backend.backend()}
    result = _smoke(name, args, expected, tmp_path, backend)
    assert "LowPrecisionOptimizer(AdamW" in result.stdout


@pytest.mark.tensorflow  # common.py imports TensorFlow
def test_libraries_import(tmp_path):
    # One process for all: each import is checked on its own line.
    code = f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r})\n"
    for name in sorted(LIBRARIES):
        module = name.removesuffix(".py")
        code += f"import {module}; print('imported', {module!r})\n"
    result = _run(["-c", code], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = {line.split()[-1] for line in result.stdout.splitlines()}
    assert imported >= {name.removesuffix(".py") for name in LIBRARIES}


def test_the_language_task_text_follows_its_source(monkeypatch):
    """Each next token is one of its token's successors, the first more
    often than the last, and the floor is the successors' entropy."""
    import numpy as np

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import language_task as task

    x, y = task.sequences(64, seed=3)
    assert x.shape == y.shape == (64, task.LENGTH)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    table = task._successors()
    picks = (table[x] == y[..., None]).argmax(-1)
    assert (table[x, picks] == y).all()
    counts = np.bincount(picks.ravel(), minlength=task.SUCCESSORS)
    assert counts[0] > 3 * counts[-1]
    p = 1 / np.arange(1, task.SUCCESSORS + 1)
    p /= p.sum()
    assert abs(task.floor() + (p * np.log(p)).sum()) < 1e-12
