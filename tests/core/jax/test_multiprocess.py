"""kmp.LossScaleOptimizer on several JAX processes: one model, one step.

Two processes on localhost join `jax.distributed` (gloo collectives on the
CPU, one device each) and train the model of `tests.support.distributed`
with `keras.distribution.DataParallel` over both devices, each feeding its
half of every batch: with `fit` and with the documented jitted loop
(tests/support/jax_multiprocess_worker.py). Process 1 alone has an inf in
its data at one step. Keras compiles one program for both processes, so the
gradients are summed across them inside the step and kmp checks the same
sum on each. (There is no per-process gradient to corrupt after that sum,
as the torch tests do: in JAX's single program both hold the same array.)
"""

import pickle
import re

import pytest

from tests.support import backends

# JAX only: skipped, before anything imports it, elsewhere.
backends.require("jax")
# With -n: two processes of its own: never beside another such test.
pytestmark = [pytest.mark.jax, pytest.mark.xdist_group("multiprocess")]

import jax  # noqa: E402

from tests.support import distributed as dd  # noqa: E402
from tests.support import jax_multiprocess_worker as worker  # noqa: E402

SCENARIOS = worker.SCENARIOS
TRAIN = {"fit": worker.train_fit, "jit": worker.train_jitted}


def _launch(script, arguments, **env):
    """Runs `script` as two processes, with `arguments(port, process_id)`
    (a free port for the coordinator); returns their stdouts."""
    port = dd.free_port()
    commands = [
        dd.python_command(script, *arguments(port, process))
        for process in range(dd.PROCESSES)
    ]
    return dd.run_together(commands, dd.environment("jax", **env))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """What each process recorded, in process order."""
    out_dir = tmp_path_factory.mktemp("jax_multiprocess")
    _launch(
        "tests/support/jax_multiprocess_worker.py",
        lambda port, process: (port, process, out_dir),
    )
    loaded = []
    for process in range(dd.PROCESSES):
        with open(out_dir / f"process{process}.pkl", "rb") as file:
            loaded.append(pickle.load(file))
    for result in loaded:
        assert (result["processes"], result["devices"]) == (2, 2)
    return loaded


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_processes_hold_the_same_state_after_every_step(results, scenario):
    first, second = (r["states"][scenario] for r in results)
    assert len(first) == len(second) == dd.STEPS + 1
    for step, (a, b) in enumerate(zip(first, second)):
        dd.assert_equal_bit_for_bit(a, b, f"{scenario}, after step {step}")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_fault_on_one_process_skips_the_step_on_both(results, scenario):
    expected = dd.expected_scale_states({dd.DATA_FAULT_STEP})
    for process, result in enumerate(results):
        states = result["states"][scenario]
        assert [s["scale_state"] for s in states[1:]] == expected, process
        for step in range(dd.STEPS):
            before, after = states[step], states[step + 1]
            unchanged = [
                a.tobytes() == b.tobytes()
                for a, b in zip(
                    before["weights"] + before["inner"],
                    after["weights"] + after["inner"],
                )
            ]
            if step == dd.DATA_FAULT_STEP:
                assert all(unchanged), (process, step)
            else:
                assert not any(unchanged[:4]), (process, step)  # Weights.


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_training_equals_one_process_on_the_whole_batch(results, scenario):
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip(
            "needs 2 CPU devices: XLA_FLAGS="
            "--xla_force_host_platform_device_count=2 (tests/conftest.py)"
        )
    distributed = results[0]["states"][scenario]
    train = TRAIN[scenario]
    # One process over two devices runs the same program: bit for bit.
    two_devices = train(
        dd.X, dd.Y, dd.GLOBAL_BATCH, worker.data_parallel(devices[:2])
    )
    for step, (a, b) in enumerate(zip(distributed, two_devices)):
        dd.assert_equal_bit_for_bit(a, b, f"{scenario}, after step {step}")
    # One device, the whole batch at once: as close as float16 allows.
    one_device = train(dd.X, dd.Y, dd.GLOBAL_BATCH)
    for step, (a, b) in enumerate(zip(distributed, one_device)):
        dd.assert_close(a, b, f"{scenario}, after step {step}")


def test_the_example_trains_on_two_processes():
    """examples/jax_multiprocess.py, launched as its docstring says."""
    out, _ = _launch(
        "examples/jax_multiprocess.py",
        lambda port, process: (
            f"--process_id={process}",
            f"--coordinator=localhost:{port}",
        ),
        KMP_EXAMPLE_SMALL="1",
    )
    assert "processes: 2" in out and "devices: 2" in out
    assert "compute dtype: float16" in out
    first, last = map(
        float, re.search(r"loss went from ([\d.]+) to ([\d.]+)", out).groups()
    )
    assert last < first
    assert "skipped steps: 0" in out and "loss scale: 32768" in out
    assert "same weights and loss scale on every process: True" in out


@pytest.fixture(scope="module")
def mismatches(tmp_path_factory):
    """What each process recorded with other settings on process 1."""
    out_dir = tmp_path_factory.mktemp("jax_mismatch")
    _launch(
        "tests/support/jax_multiprocess_worker.py",
        lambda port, process: (port, process, out_dir, "mismatch"),
    )
    loaded = []
    for process in range(dd.PROCESSES):
        with open(out_dir / f"process{process}.pkl", "rb") as file:
            loaded.append(pickle.load(file)["mismatch"])
    return loaded


@pytest.mark.parametrize(
    "name, setting, values",
    [
        ("initial_scale", "initial_scale", ("8.0", "1024.0")),
        ("growth_factor", "growth_factor", ("2.0", "3.0")),
        ("growth_factor_at_build", "growth_factor", ("2.0", "3.0")),
    ],
)
def test_settings_that_differ_across_processes_raise(
    mismatches, name, setting, values
):
    first, second = (m[name] for m in mismatches)
    assert first == second and first is not None
    assert first.startswith("kmp.LossScaleOptimizer: ")
    assert (
        f"{setting} is {values[0]} on process 0, {values[1]} on process 1"
    ) in first
