"""What the multi-process tests share: model, data, faults and the launcher.

Not a test module. Two processes on localhost (torch's
`DistributedDataParallel`, JAX's `jax.distributed`) each train a tiny
mixed_float16 model on their half of every global batch, with a
`kmp.LossScaleOptimizer`; the tests compare them with each other and with
one process training on the whole batch. A fault on one process only: an
inf in one row of process 1's half of batch `DATA_FAULT_STEP`, and (torch)
an inf written into process 1's gradient at `GRADIENT_FAULT_STEP`, after
the gradients were all-reduced.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import keras
import numpy as np

import kmp
from tests.support import training

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
PROCESSES = 2
GLOBAL_BATCH = 8
LOCAL_BATCH = GLOBAL_BATCH // PROCESSES
STEPS = 6
DATA_FAULT_STEP = 1
GRADIENT_FAULT_STEP = 3
# One process on the whole batch sums each gradient's rows in another order
# than two processes on halves do, and the float16 layers round those sums
# to float16 (relative 2**-11): gradients, and Adam's slots, may differ by a
# few float16 ulps, and each Adam update (learning rate 0.01) by about 1e-5.
# One step applied or skipped by mistake moves the weights by about 1e-2,
# and shows in the loss-scale state, which must be equal.
WEIGHTS_ATOL = 1e-4
SLOTS_RTOL = 2**-7  # Of the slot's largest value.
# Seconds for all processes together: a hang (a process waiting in a
# collective for one that died) fails the test rather than stalling CI.
TIMEOUT_SECONDS = 120

_RNG = np.random.default_rng(1)
X = _RNG.normal(size=(STEPS * GLOBAL_BATCH, 4)).astype("float32")
Y = _RNG.normal(size=(STEPS * GLOBAL_BATCH, 2)).astype("float32")
# Row 1 of process 1's half of the batch.
X[DATA_FAULT_STEP * GLOBAL_BATCH + LOCAL_BATCH + 1, 0] = np.inf


def model():
    """The tiny model with fixed initial weights, under the global policy
    (mixed_float16 in these tests); its output layer computes in float32."""
    result = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(2, dtype="float32"),
        ]
    )
    result.set_weights(training.INITIAL_WEIGHTS)
    return result


def optimizer(eight_bit=None, **kwargs):
    """A dynamic scale from 8 that grows after 2 finite steps in a row
    (unless `kwargs` say otherwise), around Adam, or with `eight_bit` (a
    quantized slot dtype, `"8bit"`, `"4bit"` or `"float8"`) around
    `kmp.LowPrecisionOptimizer(Adam, slot_dtype=eight_bit)` whose first
    kernel (32 elements) has quantized moments in 2 blocks."""
    settings = {"initial_scale": 8, "dynamic_growth_steps": 2, **kwargs}
    inner = keras.optimizers.Adam(0.01)
    if eight_bit:
        inner = kmp.LowPrecisionOptimizer(
            inner,
            slot_dtype=eight_bit,
            block_size=16,
            min_8bit_size=32,
            seed=0,
        )
    return kmp.LossScaleOptimizer(inner, **settings)


def rows(step, process=None):
    """The rows of global batch `step`, or of `process`'s half of it."""
    start = step * GLOBAL_BATCH
    if process is not None:
        start += process * LOCAL_BATCH
        return slice(start, start + LOCAL_BATCH)
    return slice(start, start + GLOBAL_BATCH)


def local_data(process):
    """`process`'s halves of every batch, in order: (x, y)."""
    everything = np.arange(STEPS * GLOBAL_BATCH)
    indices = np.concatenate(
        [everything[rows(s, process)] for s in range(STEPS)]
    )
    return X[indices], Y[indices]


def host_value(value):
    """A variable's value as NumPy (JAX: this process's copy of it)."""
    if hasattr(value, "addressable_data"):  # A jax.Array, maybe global.
        value = value.addressable_data(0)
    return np.array(keras.ops.convert_to_numpy(value))


def snapshot(model, optimizer):
    """The model's weights, the inner optimizer's variables (slots,
    `iterations`) and the loss-scale state, as plain values."""
    return {
        "weights": [host_value(v.value) for v in model.weights],
        "inner": [
            host_value(v.value) for v in optimizer.inner_optimizer.variables
        ],
        "scale_state": (
            float(host_value(optimizer.dynamic_scale.value)),
            int(host_value(optimizer.step_counter.value)),
            int(host_value(optimizer.skipped_steps_variable.value)),
            int(host_value(optimizer.inner_optimizer.iterations.value)),
        ),
    }


def expected_scale_states(bad_steps, initial=8.0, growth_steps=2):
    """(scale, counter, skipped steps, iterations) after each step, by the
    rule: halve and skip on a bad step, double after `growth_steps` finite
    steps in a row."""
    scale, counter, skipped, iterations = initial, 0, 0, 0
    states = []
    for step in range(STEPS):
        if step in bad_steps:
            scale, counter, skipped = scale / 2, 0, skipped + 1
        elif counter + 1 == growth_steps:
            scale, counter, iterations = scale * 2, 0, iterations + 1
        else:
            counter, iterations = counter + 1, iterations + 1
        states.append((scale, counter, skipped, iterations))
    return states


def assert_equal_bit_for_bit(state, other, what):
    """Two `snapshot`s hold the same values, bit for bit."""
    assert state["scale_state"] == other["scale_state"], what
    for name in ("weights", "inner"):
        for index, (a, b) in enumerate(zip(state[name], other[name])):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (
                f"{what}: {name}[{index}] differs by up to "
                f"{np.max(np.abs(a.astype('float64') - b)):.3g}"
            )


def assert_close(
    state, other, what, weights_atol=WEIGHTS_ATOL, slots_rtol=SLOTS_RTOL
):
    """Two `snapshot`s of the same training, computed in different orders:
    the same loss-scale state, weights and slots within the bounds above
    (or those given)."""
    assert state["scale_state"] == other["scale_state"], what
    for index, (a, b) in enumerate(zip(state["weights"], other["weights"])):
        np.testing.assert_allclose(
            a, b, rtol=0, atol=weights_atol, err_msg=f"{what}: weight {index}"
        )
    for index, (a, b) in enumerate(zip(state["inner"], other["inner"])):
        # As float64: 8-bit codes (uint8) would wrap around when subtracted.
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        atol = slots_rtol * float(np.max(np.abs(b)))
        np.testing.assert_allclose(
            a, b, rtol=0, atol=atol, err_msg=f"{what}: slot {index}"
        )


# --- Launching ----------------------------------------------------------------


def free_port() -> int:
    """A TCP port nobody listens on now (for a coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(backend, **extra):
    """The environment of a child process: Keras on `backend`, this checkout
    first on the import path, and no device splitting of tests/conftest.py
    (each process has one CPU device)."""
    env = dict(os.environ, KERAS_BACKEND=backend, **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    flags = env.pop("XLA_FLAGS", "").split()
    flags = [f for f in flags if "host_platform_device_count" not in f]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


def python_command(*arguments):
    return [sys.executable, *map(str, arguments)]


def _stop(processes, grace_seconds=10):
    """Terminates the processes still running, then kills them. SIGTERM
    first: torchrun starts its workers in sessions of their own and stops
    them only when it is terminated, not killed."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    for process in running:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def run_together(commands, env, timeout=TIMEOUT_SECONDS):
    """Runs the commands at once from the repository root; returns their
    outputs. Fails, with the end of each one's stderr, as soon as one exits
    with an error or when they have not all finished within `timeout`
    seconds; every process still running is then stopped."""
    processes, outputs = [], []
    try:
        for command in commands:
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            outputs.append((out, err))
            processes.append(
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in processes):
            if any(p.poll() not in (None, 0) for p in processes):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        _stop(processes)
    texts = []
    for out, err in outputs:
        out.seek(0)
        err.seek(0)
        texts.append((out.read().decode(), err.read().decode()))
        out.close()
        err.close()
    failures = [
        f"process {i} ({' '.join(commands[i][1:])}) exited with code "
        f"{p.returncode}:\n{texts[i][1][-3000:]}"
        for i, p in enumerate(processes)
        if p.returncode != 0
    ]
    assert not failures, (
        f"not all finished within {timeout} s, or one failed:\n"
        + "\n".join(failures)
    )
    return [out for out, _ in texts]
