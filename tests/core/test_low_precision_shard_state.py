"""Optimizer state split over the data axis (`shard_state=True`, JAX).

Under `keras.distribution.DataParallel` on 4 host devices, and under
`ModelParallel` on a 2x2 ("batch", "model") mesh whose kernels are split
on "model", `kmp.LowPrecisionOptimizer(AdamW, shard_state=True)` lays each
kernel's state (float32 moments; 8-bit codes and block scales) over the
"batch" axis: each device holds a quarter of it, training gives the
unsplit run's losses and variables within float32 rounding, in `fit` and
in a jitted loop over `stateless_apply` (whose weights stay replicated),
the compiled step adds one all-gather per split variable, a step
`kmp.LossScaleOptimizer` skips leaves every shard bit for bit, `.keras`
files and `.weights.h5` checkpoints load back split and resume bit for
bit, and into one device, and a variable none of whose axes the devices
divide is refused at build. Everything runs in one process of its own
(tests/support/shard_state_worker.py): the suite's processes have 2
devices (tests/conftest.py), and JAX's device count is fixed at start.
The argument checks and the axis choice are tested in
tests/core/low_bit/test_sharded_state.py.
"""

import pickle
import subprocess

import numpy as np
import pytest

from tests.support import backends
from tests.support import distributed as dd

backends.require("jax")
# Starts a JAX process of its own: never beside another such test.
pytestmark = [pytest.mark.jax, pytest.mark.xdist_group("multiprocess")]

# The goal: a quarter of the state on each of 4 devices, plus the small
# slots every device keeps (the biases').
RATIO = 0.30


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """What the 4-device process recorded (the worker's docstring).

    About 30 s on 2 cores, most of it compiling: 8 training runs (float32
    and 8-bit state, split and whole, under each distribution), a skipped
    step under `kmp.LossScaleOptimizer`, two round trips, each of which
    compiles the step of three loaded models, two jitted loops and two
    compiled steps whose HLO is read; each is its own program, and the
    split run is compared with the whole one in the same process.
    """
    out = tmp_path_factory.mktemp("shard_state") / "results.pkl"
    env = dd.environment("jax")
    flags = env.get("XLA_FLAGS", "").split()
    flags.append("--xla_force_host_platform_device_count=4")
    env["XLA_FLAGS"] = " ".join(flags)
    completed = subprocess.run(
        dd.python_command("tests/support/shard_state_worker.py", out),
        cwd=dd.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=dd.TIMEOUT_SECONDS,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    with open(out, "rb") as file:
        return pickle.load(file)


SLOT_DTYPES = (None, "8bit")


def _same_bits(got, want):
    assert len(got) == len(want)
    for n, ((_, a), (_, b)) in enumerate(zip(got, want)):
        assert a.tobytes() == b.tobytes(), n


def _within_rounding(got, want, what):
    """The same arithmetic in another partition: float32 roundings apart
    (on this machine, bit for bit). Where one moves an 8-bit slot across a
    code's midpoint, the code takes its neighbour."""
    assert len(got) == len(want), what
    for n, ((dtype, a), (_, b)) in enumerate(zip(got, want)):
        if dtype == "uint8":
            assert np.mean(a == b) >= 0.999, (what, n)
            continue
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=what)


@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=["float32", "8bit"])
@pytest.mark.parametrize("layout", ["dp", "2x2"])
def test_each_device_holds_a_quarter_of_the_state(results, layout, slot_dtype):
    # Against the replicated (DataParallel) run: under ModelParallel the
    # state is split over both axes.
    replicated = results["dp", slot_dtype, False]["bytes"]
    split = results[layout, slot_dtype, True]["bytes"]
    assert split / replicated <= RATIO, (layout, slot_dtype, split)


@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=["float32", "8bit"])
@pytest.mark.parametrize("layout", ["dp", "2x2"])
def test_the_state_lies_on_the_data_axis(results, layout, slot_dtype):
    found = results[layout, slot_dtype, True]["specs"]
    model_axis = "model" if layout == "2x2" else None
    assert found["kernel"] == (None, model_axis)
    names = ["momentum", "velocity"]
    if slot_dtype:
        names = [f"{n}_{slot_dtype}" for n in names]
        # A block holds 2 rows of 128 columns: the scales' one column lies
        # on no "model" device of its own.
        scales = found["momentum_scale"], found["velocity_scale"]
        assert scales == (("batch", None), ("batch", None))
    for name in names:
        assert found[name] == ("batch", model_axis), name
    whole = results[layout, slot_dtype, False]["specs"]
    assert whole[names[0]] == (None, model_axis)


@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=["float32", "8bit"])
@pytest.mark.parametrize("layout", ["dp", "2x2"])
def test_training_is_the_unsplit_runs(results, layout, slot_dtype):
    split = results[layout, slot_dtype, True]
    whole = results[layout, slot_dtype, False]
    np.testing.assert_allclose(split["losses"], whole["losses"], rtol=1e-6)
    _within_rounding(split["state"], whole["state"], (layout, slot_dtype))


def test_a_skipped_step_leaves_every_shard_bit_for_bit(results):
    found = results["skip"]
    before, after = found["scales"]
    assert after == before / 2  # The step was skipped.
    assert found["after"] == found["before"]
    assert found["specs"]["compensation"] == ("batch", None)
    assert found["specs"]["momentum_8bit"] == ("batch", None)


@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=["float32", "8bit"])
@pytest.mark.parametrize("form", ["keras", "checkpoint"])
def test_a_saved_run_loads_split_and_resumes_bit_for_bit(
    results, form, slot_dtype
):
    trip = results["round_trip", slot_dtype]
    prefix = "loaded" if form == "keras" else "checkpoint"
    resumed = "resumed" if form == "keras" else "checkpoint_resumed"
    split = results["dp", slot_dtype, True]["specs"]
    assert trip[f"{prefix}_specs"] == split
    _same_bits(trip[prefix], trip["saved"])
    _same_bits(trip[resumed], trip["uninterrupted"])


@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=["float32", "8bit"])
def test_a_keras_file_loads_onto_one_device(results, slot_dtype):
    trip = results["round_trip", slot_dtype]
    assert trip["one_device_whole"]
    _same_bits(trip["one_device"], trip["saved"])
    # One device sums the batch's gradients in another order.
    _within_rounding(
        trip["one_device_resumed"], trip["uninterrupted"], slot_dtype
    )


def test_a_jitted_loop_keeps_the_weights_replicated(results):
    split, whole = results["loop", True], results["loop", False]
    assert all(not any(axes) for axes in split["weights"])
    assert split["slots"] and all(s[0] == "batch" for s in split["slots"])
    for a, b in zip(split["state"], whole["state"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_step_gathers_each_split_variable_once(results):
    split = results["collectives", True]
    whole = results["collectives", False]["counts"]
    added = dict(split["counts"])
    gathers = added.pop("all-gather", 0) - whole.get("all-gather", 0)
    # XLA may combine gathers; it must add no other collective.
    assert 0 < gathers <= split["split_variables"] == 2
    assert added == {k: v for k, v in whole.items() if k != "all-gather"}


def test_a_variable_no_axis_of_which_divides_is_refused(results):
    found = results["refused"]
    message = found["message"]
    assert "cannot split the optimizer state of '" in message
    assert "kernel' (shape (3, 4099))" in message
    assert "4 devices of mesh axis 'batch' (mesh {'batch': 4})" in message
    assert "Pad an axis to a multiple of 4" in message
    assert not found["built"] and found["unchanged"]


def test_the_summary_gives_the_state_per_device(results):
    text = results["summary"]
    line = next(s for s in text.splitlines() if "per device" in s)
    expected = f"{results['dp', '8bit', True]['bytes']:,} bytes"
    assert line == f"Optimizer state per device (4 devices): {expected}"
