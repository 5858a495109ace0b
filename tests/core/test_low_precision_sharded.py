"""Quantized optimizer state sharded like its variable (JAX).

Under `keras.distribution.ModelParallel` on 4 host devices, with a
`LayoutMap` sharding a 2-layer MLP's 256x256 kernels on either axis of a
4-device mesh or on the "model" axis of a 2x2 ("batch", "model") one, the
8-bit and 4-bit slots of `kmp.LowPrecisionOptimizer` (AdamW) carry their
kernel's layout: each device holds a quarter (or half) of the codes, so the
state per device is a fraction of float32 AdamW's under the same layout,
training gives the one-device result within rounding, a `.keras` file loads
back sharded and resumes bit for bit, `kmp.summary` gives the bytes per
device, and a layout that cannot shard a slot's blocks is refused at build,
naming the variable and why. Everything runs in one process of its own
(tests/support/sharded_state_worker.py): the suite's processes have 2
devices (tests/conftest.py), and JAX's device count is fixed at start.
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

from tests.support import sharded_state_worker as worker  # noqa: E402

# The goals (issue 39): per-device state against float32 AdamW's.
RATIO = {"8bit": 0.35, "4bit": 0.27}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """What the 4-device process recorded (the worker's docstring).

    About 20 s on 2 cores, most of it compiling: 14 training runs, each its
    own program (3 layouts x float32, 8-bit and 4-bit AdamW, the one-device
    references, two `.keras` round trips). Each layout shards the slots
    differently (columns: scales on every device; rows: scales sharded; 2x2:
    4-bit scales sharded, 8-bit not), and the ratios are against float32
    AdamW under that same layout, so none can stand in for another.
    """
    out = tmp_path_factory.mktemp("sharded") / "results.pkl"
    env = dd.environment("jax")
    flags = env.get("XLA_FLAGS", "").split()
    flags.append("--xla_force_host_platform_device_count=4")
    env["XLA_FLAGS"] = " ".join(flags)
    completed = subprocess.run(
        dd.python_command("tests/support/sharded_state_worker.py", out),
        cwd=dd.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=dd.TIMEOUT_SECONDS,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    with open(out, "rb") as file:
        return pickle.load(file)


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
@pytest.mark.parametrize("slot_dtype", worker.SLOT_DTYPES)
def test_state_per_device_is_a_fraction_of_float32_adamws(
    results, layout, slot_dtype
):
    adamw = results["bytes"][layout, None]
    ratio = results["bytes"][layout, slot_dtype] / adamw
    assert ratio <= RATIO[slot_dtype], (layout, slot_dtype, ratio)


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
@pytest.mark.parametrize("slot_dtype", worker.SLOT_DTYPES)
def test_the_codes_are_sharded_like_their_kernel(results, layout, slot_dtype):
    found = results["shardings"][layout, slot_dtype]
    kernel = found["kernel"]
    assert kernel == worker.LAYOUTS[layout][2]
    assert found[f"momentum_{slot_dtype}"] == kernel
    assert found[f"velocity_{slot_dtype}"] == kernel
    # A scale per block: sharded where each device holds whole blocks
    # (rows; 4-bit blocks of 128 on 2 devices of 128 columns each), else
    # on every device (1/256 of the codes' elements, 4 bytes each).
    scales = kernel if layout == "rows" else (None, None)
    if (layout, slot_dtype) == ("2x2", "4bit"):
        scales = kernel
    assert found["momentum_scale"] == found["velocity_scale"] == scales


def _assert_within_rounding(got, want, what):
    """The sharded program sums the matrix products' parts in another
    order than one device: float32 roundings apart (float32 AdamW's own
    weights differ by up to 1e-5 here). Where that moves a slot's value
    across a code's midpoint, the code takes its neighbour (a few in ten
    thousand), and that element's later updates differ by the code's
    step: at most a tenth of one update (lr 1e-2) after 4 steps."""
    assert len(got) == len(want), what
    for n, ((dtype, a), (_, b)) in enumerate(zip(got, want)):
        if dtype == "uint8":
            assert np.mean(a == b) >= 0.999, (what, n)
            continue
        difference = np.abs(a.astype("float64") - b)
        beyond = difference > 1e-5 + 1e-4 * np.abs(b)
        assert np.mean(beyond) <= 1e-3, (what, n, np.mean(beyond))
        assert difference.max() <= 1e-3, (what, n, difference.max())


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
@pytest.mark.parametrize("slot_dtype", (None, *worker.SLOT_DTYPES))
def test_the_sharded_run_is_the_one_device_run(results, layout, slot_dtype):
    # None: float32 AdamW, whose difference is float32 rounding alone.
    _assert_within_rounding(
        results["equal"][layout, slot_dtype],
        results["one_device", slot_dtype],
        (layout, slot_dtype),
    )


@pytest.mark.parametrize("slot_dtype", worker.SLOT_DTYPES)
def test_a_keras_file_loads_sharded_and_resumes_bit_for_bit(
    results, slot_dtype
):
    trip = results["round_trip", slot_dtype]
    assert trip["shardings"] == results["shardings"]["columns", slot_dtype]
    for (_, got), (_, want) in zip(trip["resumed"], trip["uninterrupted"]):
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("slot_dtype", worker.SLOT_DTYPES)
def test_the_summary_gives_the_state_per_device(results, slot_dtype):
    text = results["summary", slot_dtype]
    line = next(s for s in text.splitlines() if "per device" in s)
    expected = f"{results['bytes']['columns', slot_dtype]:,} bytes"
    assert line.startswith("Optimizer state per device (4 devices): ")
    assert line.endswith(expected), line


def test_a_layout_that_cannot_shard_the_blocks_is_refused(results):
    rows = results["error", "rows"]
    assert "The 8bit momentum slot of '" in rows
    assert "dense" in rows and "kernel' (shape (16, 300))" in rows
    assert "layout (None, 'model')" in rows
    assert "its blocks of 256 elements run across its rows" in rows
    assert "Pass a block_size" in rows
    pairs = results["error", "pairs"]
    assert "kernel' (shape (1024, 4))" in pairs
    assert "holds 1 of its 4 columns, an odd number" in pairs
