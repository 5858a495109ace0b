"""One process of tests/core/jax/test_multiprocess.py, and its training.

Not a test module. Started once per process,

    python tests/support/jax_multiprocess_worker.py PORT PROCESS_ID OUT_DIR \
        [mismatch]

each process joins `jax.distributed` (coordinator on localhost:PORT, gloo
collectives on the CPU), and trains `tests.support.distributed`'s model
under mixed_float16 with `keras.distribution.DataParallel` over the devices
of both processes, on its half of every batch: with `fit` and with the
documented jitted loop (examples/jax_custom_loop.py). It writes its
`snapshot` after every step to OUT_DIR/process<id>.pkl. The test computes
its one-process references with `train_fit` and `train_jitted` too. With
`mismatch`, it instead creates optimizers with other settings on process
1 (`MISMATCHES`) and records the error each raised.
"""

import contextlib
import os
import pickle
import sys

from tests.support import backends

backends.require("jax")

import jax  # noqa: E402
import keras  # noqa: E402

import kmp  # noqa: E402
from tests.support import distributed as dd  # noqa: E402

SCENARIOS = ("fit", "jit")
# Settings process 1 gets and process 0 does not, and whether the optimizer
# is created under the distribution (else only built under it).
MISMATCHES = {
    "initial_scale": ({"initial_scale": 1024}, True),
    "growth_factor": ({"growth_factor": 3}, True),
    "growth_factor_at_build": ({"growth_factor": 3}, False),
}


def data_parallel(devices):
    """DataParallel over `devices`; each process brings its own rows."""
    distribution = keras.distribution.DataParallel(devices=devices)
    distribution.auto_shard_dataset = False
    return distribution


def _build(distribution):
    kmp.set_global_policy("mixed_float16")
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        # Every process must create the same initial values (set_weights
        # then gives them the shared ones).
        keras.utils.set_random_seed(0)
        model = dd.model()
        optimizer = dd.optimizer()
        optimizer.build(model.trainable_variables)
    return model, optimizer


class _Record(keras.callbacks.Callback):
    def __init__(self, optimizer):
        super().__init__()
        self.optimizer = optimizer
        self.states = []

    def on_train_begin(self, logs=None):
        self.states.append(dd.snapshot(self.model, self.optimizer))

    def on_train_batch_end(self, batch, logs=None):
        # Reading self.model writes the trainer's state back first.
        self.states.append(dd.snapshot(self.model, self.optimizer))


def train_fit(x, y, batch_size, distribution=None):
    """`model.fit` on this process's `x`, `y` (`batch_size` rows of each
    batch); the `snapshot` before and after every step."""
    model, optimizer = _build(distribution)
    record = _Record(optimizer)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(
            x, y, batch_size=batch_size, shuffle=False, verbose=0,
            callbacks=[record],
        )  # fmt: skip
    kmp.set_global_policy(None)
    return record.states


def _make_train_step(model, optimizer, loss_fn):
    """examples/jax_custom_loop.py's step."""

    @jax.jit
    def train_step(state, x, y):
        trainable, non_trainable, optimizer_values = state

        def scaled_loss(trainable):
            y_pred, non_trainable_after = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            loss = loss_fn(y, y_pred)
            scaled = optimizer.stateless_scale_loss(optimizer_values, loss)
            return scaled, (loss, non_trainable_after)

        (_, (loss, non_trainable)), grads = jax.value_and_grad(
            scaled_loss, has_aux=True
        )(trainable)
        grads = optimizer.stateless_unscale_gradients(optimizer_values, grads)
        trainable, optimizer_values = optimizer.stateless_apply(
            optimizer_values, grads, trainable, scaled=False
        )
        return (trainable, non_trainable, optimizer_values), loss

    return train_step


def global_batch(distribution, local):
    """This process's rows as (its part of) one array over all devices."""
    if distribution is None:
        return local
    shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    sharding = distribution.get_data_layout(shape).backend_layout
    return jax.make_array_from_process_local_data(sharding, local)


def train_jitted(x, y, batch_size, distribution=None):
    """The documented jitted loop on this process's `x`, `y`; the
    `snapshot` before and after every step."""
    model, optimizer = _build(distribution)
    train_step = _make_train_step(
        model, optimizer, keras.losses.MeanSquaredError()
    )
    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        optimizer.variables,
    )
    state = tuple([v.value for v in group] for group in groups)
    states = [dd.snapshot(model, optimizer)]
    for start in range(0, len(x), batch_size):
        batch = slice(start, start + batch_size)
        state, _ = train_step(
            state,
            global_batch(distribution, x[batch]),
            global_batch(distribution, y[batch]),
        )
        optimizer.check_persistent_skips(state[2])
        for group, values in zip(groups, state):
            for variable, value in zip(group, values):
                variable.assign(value)
        states.append(dd.snapshot(model, optimizer))
    kmp.set_global_policy(None)
    return states


def mismatch(name, process_id, distribution):
    """The error creating (or building) the optimizer raised, with other
    settings on process 1."""
    settings, created_under = MISMATCHES[name]
    settings = settings if process_id == 1 else {}
    kmp.set_global_policy("mixed_float16")
    try:
        with distribution.scope():
            keras.utils.set_random_seed(0)  # As _build.
            model = dd.model()
        scope = distribution.scope() if created_under else (
            contextlib.nullcontext()
        )  # fmt: skip
        with scope:
            optimizer = dd.optimizer(**settings)
        with distribution.scope():
            optimizer.build(model.trainable_variables)
    except ValueError as error:
        return str(error)
    finally:
        kmp.set_global_policy(None)
    return None


def main(port, process_id, out_dir, mode="train"):
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=dd.PROCESSES,
        process_id=process_id,
        initialization_timeout=dd.TIMEOUT_SECONDS,
    )
    distribution = data_parallel(jax.devices())
    x, y = dd.local_data(process_id)
    results = {
        "processes": jax.process_count(),
        "devices": jax.device_count(),
    }
    if mode == "mismatch":
        results["mismatch"] = {
            name: mismatch(name, process_id, distribution)
            for name in MISMATCHES
        }
    else:
        results["states"] = {
            "fit": train_fit(x, y, dd.LOCAL_BATCH, distribution),
            "jit": train_jitted(x, y, dd.LOCAL_BATCH, distribution),
        }
    with open(os.path.join(out_dir, f"process{process_id}.pkl"), "wb") as file:
        pickle.dump(results, file)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
