"""guides/bfloat16_weights.py and benchmarks/bf16_all_the_way.py run and
show what they say.

Both start together when this module starts, each as a fresh interpreter
would (`tests.support.warm`):
the guide (TensorFlow) with `KMP_GUIDE_SMALL=1`, the benchmark with
`--quick` on two configurations, on the backend the tests run on. The tests
check the facts the guide's prose states against what it printed, and that
the benchmark prints its tables and goals, whether or not the machine's
allocator keeps statistics (the case without is also simulated).
"""

import json
import os
import pathlib
import re
import sys

import keras
import pytest

from tests.support import backends
from tests.support import warm

# With -n: the scripts a module starts run once, on one worker.
pytestmark = pytest.mark.xdist_group("low_precision_scripts")

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUIDE = ["guides/bfloat16_weights.py"]
# On every backend: it uses Keras's API only.
EIGHT_BIT_GUIDE = ["guides/eight_bit_state.py"]
BENCHMARK = [
    "benchmarks/bf16_all_the_way.py",
    "--quick",
    "--tasks",
    "digits,memory",
    "--configs",
    "float32,bf16+kahan",
    "--plot",
    "",
]
_running = {}
_outputs = {}
_results = {}  # "file": the result file the benchmark writes (--results)


def _environment(directory):
    return dict(
        os.environ,
        KMP_GUIDE_SMALL="1",
        KERAS_BACKEND=backends.NAME,
        TF_CPP_MIN_LOG_LEVEL="3",
        TMPDIR=str(directory),
    )


# Over 20 s (CONTRIBUTING.md): the first test waits for the guide and the
# benchmark, each a fresh interpreter that imports TensorFlow and trains;
# they run once for the whole module, side by side.
@pytest.fixture(scope="module", autouse=True)
def _start_scripts(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bf16")
    environment = _environment(directory)
    _results["file"] = directory / "bf16_all_the_way.json"
    benchmark = BENCHMARK + ["--results", str(_results["file"])]
    scripts = [GUIDE, benchmark] if backends.TENSORFLOW else [benchmark]
    scripts.append(EIGHT_BIT_GUIDE)
    for command in scripts:
        _running[command[0]] = warm.start(command, env=environment, cwd=ROOT)
    yield
    for process in _running.values():
        process.kill()


def _output(command):
    """The script's stdout, once it has finished; fails unless it exited 0."""
    name = command[0]
    if name not in _outputs:
        done = _running[name].wait(timeout=300)
        assert done.returncode == 0, (
            f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
        _outputs[name] = done.stdout
    return _outputs[name]


@pytest.fixture(scope="module")
def guide():
    if not backends.TENSORFLOW:
        pytest.skip("the guide runs on TensorFlow")
    return _output(GUIDE)


def test_guide_shows_why_bfloat16_weights_stall(guide):
    assert "bfloat16: 1 + 0.001 = 1.0" in guide
    assert "bfloat16: 0.999 = 1.0" in guide
    assert "Keras Adam, 5 steps on bfloat16: [1. 1. 1.]" in guide
    for rounding in ("kahan", "stochastic"):
        moved = re.search(rf"{rounding}, 5 steps on bfloat16: \[(\S+)", guide)
        assert moved and float(moved.group(1)) < 0.96


def test_guide_stream_errors_are_as_described(guide):
    errors = dict(
        (name, (float(average), float(mean)))
        for name, average, mean in re.findall(
            r"(\S+(?: SGD)?) after \d+ tiny steps: error ([\d.]+) ulp on "
            r"average, mean ([-+\d.]+) ulp",
            guide,
        )
    )
    assert errors["kahan"][0] < 0.5
    assert abs(errors["stochastic"][1]) < 1.5 < errors["stochastic"][0]
    assert errors["nearest"][1] < -5 and errors["Keras SGD"][1] < -5


def test_guide_trains_digits_in_pure_bfloat16(guide):
    rows = dict(
        (name.strip(), (float(accuracy), int(size)))
        for name, accuracy, size in re.findall(
            r"(.+): test accuracy +([\d.]+)%, train loss [\d.]+, (\d+) bytes",
            guide,
        )
    )
    assert rows["float32"][1] == rows["mixed_bfloat16"][1] == 12
    assert rows["mixed_bfloat16, bf16 slots"][1] == 8
    assert rows["bfloat16 + kahan"][1] == 8
    assert rows["bfloat16 + stochastic"][1] == 6
    assert rows["bfloat16, Keras Adam"][0] < 30  # Never moves.
    for name in ("bfloat16 + kahan", "bfloat16 + stochastic"):
        assert rows[name][0] > rows["float32"][0] - 3


def test_guide_reloads_bfloat16_slots(guide):
    assert (
        "reloaded slots: ['bfloat16', 'float32', 'int64'] same values: True"
        in guide
    )
    assert "float16 recipe: LowPrecisionOptimizer" in guide


def test_eight_bit_guide_shows_the_bytes_and_the_same_accuracy():
    out = _output(EIGHT_BIT_GUIDE)
    assert "float32 Adam: 12.00 B/parameter" in out
    assert "bfloat16 + 8-bit state: 4.03 B/parameter" in out
    assert "values of the code: 256" in out
    assert "between 0.1 and 1: 129 of them" in out
    assert "optimizer: LowPrecisionOptimizer 8bit stochastic" in out
    rows = {
        name.strip(): (float(accuracy), float(per_parameter))
        for name, accuracy, per_parameter in re.findall(
            r"(.+): test accuracy ([\d.]+)%; .*weights \+ state ([\d.]+) "
            "bytes per parameter",
            out,
        )
    }
    assert rows["float32 Adam"][1] == 12.0
    assert 4.0 < rows["8-bit"][1] < 4.2
    pretrained = float(re.search(r"pretrained: test accuracy ([\d.]+)", out)[1])
    for name in ("float32 Adam", "8-bit"):
        assert rows[name][0] > pretrained  # Fine-tuning helped.
    assert abs(rows["8-bit"][0] - rows["float32 Adam"][0]) <= 2.0
    assert re.search(r"8-bit slots: [1-9]", out)
    assert "every layer's Adam update stays within" in out
    assert "float16 recipe: LowPrecisionOptimizer" in out


def test_benchmark_quick_run_prints_tables_and_goals():
    out = _output(BENCHMARK)
    assert "cpu flags:" in out
    assert f"keras backend: {backends.NAME}" in out
    assert re.search(r"digits: accuracy", out)
    assert re.search(r"\nbf16\+kahan +[\d.]+ +- +[-+][\d.]+ ", out)
    assert "Goals:" in out
    assert re.search(r"digits bf16\+kahan: [\d.]+% >= float32 - 0.5", out)
    # The allocator's peak where this machine keeps statistics of it.
    measured = re.search(r"\nbf16\+kahan +[\d.]+ +[\d.]+ +[\d.]+ \[", out)
    unmeasured = re.search(
        r"\nbf16\+kahan +[\d.]+ +[\d.]+ +not measurable on this machine", out
    )
    assert bool(measured) != bool(unmeasured)
    if measured:
        assert re.search(
            r"memory bf16\+kahan: [\d.]+x of float32 <= 0.45x", out
        )
    else:
        assert "memory bf16+kahan: not measurable on this machine" in out


def test_benchmark_writes_the_performance_pages_format():
    _output(BENCHMARK)
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    import perf_results

    document = perf_results.load(_results["file"])
    assert document["source"] == "benchmarks/bf16_all_the_way.py"
    suffix = "" if backends.TENSORFLOW else f", {backends.NAME}"
    accuracy = document["tables"][0]["measurements"]
    groups = {row["group"] for row in accuracy}
    assert {g.lower() for g in groups} == {f"digits{suffix}".lower()}
    assert {row["series"] for row in accuracy} == {"float32", "bf16+kahan"}
    assert "--results" not in document["commands"][document["date"]]
    perf_results.markdown(document)


def _benchmark_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bf16_all_the_way

    return bf16_all_the_way


def test_benchmark_memory_child_without_allocator_statistics(tmp_path):
    # As on CPUs where TensorFlow raises "Allocator stats not available for
    # device 'CPU:0'" (and JAX or torch on any CPU): simulated.
    code = (
        "import sys\n"
        "sys.path.insert(0, 'benchmarks')\n"
        "import bf16_all_the_way as benchmark\n"
        "benchmark._allocator = lambda keras: None\n"
        "sys.exit(benchmark.main(['--child', 'bf16+kahan', '--quick', "
        "'--memory-steps', '1']))\n"
    )
    done = warm.run(
        ["-c", code], env=_environment(tmp_path), cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["peaks"] is None
    assert result["weights"] > 0 and result["optimizer"] > 0


@pytest.mark.tensorflow
def test_benchmark_allocator_is_none_where_tensorflow_has_no_stats(
    monkeypatch,
):
    tf = backends.tensorflow()
    benchmark = _benchmark_module(monkeypatch)

    def unavailable(device):
        raise ValueError(f"Allocator stats not available for device {device!r}")

    monkeypatch.setattr(tf.config.experimental, "get_memory_info", unavailable)
    assert benchmark._allocator(keras) is None


def test_benchmark_reports_memory_it_cannot_measure(monkeypatch, capsys):
    benchmark = _benchmark_module(monkeypatch)
    results = {
        config: {
            "weights": 1000,
            "optimizer": 2000,
            "peaks": None,
            "peak": None,
            "total": None,
            "step_seconds": 0.01,
        }
        for config in ("float32", "bf16+kahan")
    }
    benchmark._print_memory(results)
    benchmark._goals({}, results)
    out = capsys.readouterr().out
    assert re.search(r"\nbf16\+kahan +0.0 +0.0 +not measurable on this", out)
    assert "memory bf16+kahan: not measurable on this machine" in out


def test_guide_converts_a_compiled_model_to_bfloat16_weights(guide):
    assert "converted: bfloat16 LowPrecisionOptimizer kahan" in guide
