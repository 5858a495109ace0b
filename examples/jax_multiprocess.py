"""Data-parallel training on several JAX processes, with kmp's loss scaling.

Every process runs this script. `jax.distributed.initialize` connects them
(process 0 is the coordinator), `keras.distribution.DataParallel` spreads
each batch over the devices of all of them, and each process feeds its own
share of every batch to `fit`. Keras compiles one program for all the
processes: the gradients are summed across them inside the step, so kmp's
`LossScaleOptimizer` checks the same gradients everywhere, and every process
applies or skips each step together, with the same loss scale. Two
processes on the CPU (JAX's CPU collectives use gloo):

    KERAS_BACKEND=jax python examples/jax_multiprocess.py --process_id=0 &
    KERAS_BACKEND=jax python examples/jax_multiprocess.py --process_id=1
    wait

On several machines, give each the coordinator's address
(`--coordinator=HOST:PORT`) and the number of processes (`--processes`).
Set KMP_EXAMPLE_SMALL=1 for a run of a few seconds on a subset of the data.
"""

import argparse
import hashlib
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from digits import build_model  # noqa: E402
from digits import load_data  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import kmp  # noqa: E402

SMALL = os.environ.get("KMP_EXAMPLE_SMALL") == "1"
EPOCHS = 2 if SMALL else 10
GLOBAL_BATCH_SIZE = 64  # Split evenly between the processes.


def my_share(x, y, process, processes):
    """This process's rows of every whole global batch, in order."""
    rows = np.arange(len(x) // GLOBAL_BATCH_SIZE * GLOBAL_BATCH_SIZE)
    local = GLOBAL_BATCH_SIZE // processes
    mine = rows[rows % GLOBAL_BATCH_SIZE // local == process]
    return x[mine], y[mine]


def fingerprint(model) -> np.ndarray:
    """A hash of this process's copy of the weights and optimizer state."""
    sha = hashlib.sha256()
    for variable in model.weights + model.optimizer.variables:
        local_copy = variable.value.addressable_data(0)
        sha.update(np.asarray(local_copy).tobytes())
    return np.frombuffer(sha.digest(), dtype=np.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process_id", type=int, required=True)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--coordinator", default="localhost:12355")
    args = parser.parse_args()
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.processes,
        process_id=args.process_id,
    )
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    distribution.auto_shard_dataset = False  # Each process brings its rows.
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)  # The same initial weights everywhere.
    (x_train, y_train), (x_test, y_test) = load_data()
    share = (args.process_id, args.processes)
    x_train, y_train = my_share(x_train, y_train, *share)
    x_test, y_test = my_share(x_test, y_test, *share)
    kmp.set_global_policy("mixed_float16")
    model = build_model()
    model.compile(
        optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    local_batch_size = GLOBAL_BATCH_SIZE // args.processes
    history = model.fit(
        x_train,
        y_train,
        batch_size=local_batch_size,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
    )
    losses = history.history["loss"]  # Means over the global batches.
    # Like fit, evaluate runs on every process, each on its share.
    _, accuracy = model.evaluate(
        x_test, y_test, batch_size=local_batch_size, verbose=0
    )
    optimizer = model.optimizer
    fingerprints = multihost_utils.process_allgather(fingerprint(model))
    if args.process_id == 0:
        print(f"processes: {jax.process_count()}")
        print(f"devices: {jax.device_count()}")
        print(f"compute dtype: {model.layers[0].compute_dtype}")
        print(f"loss went from {losses[0]:.3f} to {losses[-1]:.3f}")
        print(f"loss scale: {float(optimizer.loss_scale):g}")
        print(f"skipped steps: {int(optimizer.skipped_steps)}")
        print(f"test accuracy: {accuracy:.3f}")
        same = bool((fingerprints == fingerprints[0]).all())
        print(f"same weights and loss scale on every process: {same}")
    kmp.set_global_policy(None)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
