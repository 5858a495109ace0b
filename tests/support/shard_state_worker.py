"""The process of tests/core/test_low_precision_shard_state.py: optimizer
state split over the data axis (`shard_state=True`) on 4 host devices.

Not a test module. Started as

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python tests/support/shard_state_worker.py OUT.pkl

it trains a 2-layer MLP of 128x128 kernels with `kmp.LowPrecisionOptimizer`
(AdamW, float32 and 8-bit state), its state split and whole, under
`keras.distribution.DataParallel` on 4 devices and `ModelParallel` on a
2x2 ("batch", "model") mesh, and records in OUT.pkl (a dict) what the test
checks: the state's bytes on each device, the losses and variables after
training, the state's shardings, every shard of every variable around a
skipped step (`kmp.LossScaleOptimizer`, bfloat16 weights with Kahan
compensation), `.keras` and `.weights.h5` round trips into 4 devices and
into one, a jitted loop over `stateless_apply`, the collectives of the
compiled step, a refused variable and `kmp.summary`'s lines.
"""

import collections
import math
import os
import pickle
import re
import sys
import tempfile

import keras
import numpy as np

import kmp
from kmp.core.low_bit import sharded_state

UNITS = 128
SLOT_DTYPES = (None, "8bit")
EPOCHS = 2
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def data(rows=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, UNITS)).astype("float32")
    y = rng.normal(size=(rows, UNITS)).astype("float32")
    return x, y


def model(units=UNITS, inputs=UNITS):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(units),
        ]
    )


def optimizer(slot_dtype, shard):
    inner = keras.optimizers.AdamW(1e-2, weight_decay=0.01)
    return kmp.LowPrecisionOptimizer(
        inner, slot_dtype=slot_dtype, seed=1, shard_state=shard
    )


def data_parallel():
    import jax  # Optional: pytest's doctest collection imports this module.

    mesh = keras.distribution.DeviceMesh((4,), ("batch",), jax.devices()[:4])
    return keras.distribution.DataParallel(device_mesh=mesh)


def model_parallel():
    import jax

    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("batch", "model"), jax.devices()[:4]
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def per_device_bytes(variables):
    """The largest number of bytes of `variables` on one device."""
    totals = collections.Counter()
    for variable in variables:
        for shard in variable.value.addressable_shards:
            totals[shard.device] += shard.data.nbytes
    return max(totals.values())


def state(trained):
    """`[(dtype, value), ...]` of the weights and the optimizer's
    variables, in order."""
    variables = trained.trainable_variables + trained.optimizer.variables
    return [(v.dtype, np.asarray(v.value)) for v in variables]


def every_shard(variables):
    """The bytes of every shard of every variable, with its device."""
    return [
        [
            (str(shard.device), np.asarray(shard.data).tobytes())
            for shard in variable.value.addressable_shards
        ]
        for variable in variables
    ]


def specs(trained):
    """`{variable name: mesh axes}` of the first kernel and of its state
    (the names after the kernel's path)."""
    kernel = trained.layers[0].kernel
    base = kernel.path.replace("/", "_")
    found = {"kernel": tuple(kernel.value.sharding.spec)}
    for variable in trained.optimizer.variables:
        name = variable.path.split("/")[-1]
        if name.startswith(base):
            found[name[len(base) + 1 :]] = tuple(variable.value.sharding.spec)
    return found


def train(where, slot_dtype, shard, weights, epochs=EPOCHS):
    """Trains from `weights` under `where`; returns the model and its
    losses."""
    x, y = data()
    with where.scope():
        trained = model()
        trained.set_weights(weights)
        trained.compile(optimizer=optimizer(slot_dtype, shard), loss="mse")
        history = trained.fit(
            x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0
        )
    return trained, history.history["loss"]


def record(trained, losses):
    return {
        "bytes": per_device_bytes(trained.optimizer.variables),
        "losses": losses,
        "state": state(trained),
        "specs": specs(trained),
    }


def skip(where):
    """Every shard of the weights and state around a step that
    `kmp.LossScaleOptimizer` skips (an inf in the batch), with bfloat16
    weights (Kahan compensation) and 8-bit state split."""
    x, y = data()
    with where.scope(), kmp.policy_scope("bfloat16"):
        trained = model()
        inner = optimizer("8bit", True)
        trained.compile(optimizer=kmp.LossScaleOptimizer(inner), loss="mse")
        trained.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        variables = trained.trainable_variables + inner.variables
        scale = float(trained.optimizer.dynamic_scale)
        before = every_shard(variables)
        bad = x[:8].copy()
        bad[0, 0] = np.inf
        trained.fit(bad, y[:8], batch_size=8, shuffle=False, verbose=0)
        after = every_shard(variables)
        return {
            "before": before,
            "after": after,
            "scales": (scale, float(trained.optimizer.dynamic_scale)),
            "specs": specs(trained),
            "compensation": [
                tuple(v.value.sharding.spec)
                for v in inner.variables
                if "compensation" in v.path and len(v.shape) == 2
            ],
        }


def one_more_step(trained):
    x, y = data()
    trained.fit(x[:8], y[:8], batch_size=8, shuffle=False, verbose=0)
    return state(trained)


def on_one_device(trained):
    """Whether every optimizer variable lies whole on one device."""
    return all(
        len(v.value.sharding.device_set) == 1
        for v in trained.optimizer.variables
    )


def round_trip(slot_dtype, where, weights, directory):
    """A split run saved to `.keras` (and `.weights.h5`) and loaded into 4
    devices and into one; each resumes for one step beside the original."""
    trained, _ = train(where, slot_dtype, True, weights)
    path = os.path.join(directory, f"split_{slot_dtype}.keras")
    checkpoint = os.path.join(directory, f"split_{slot_dtype}.weights.h5")
    trained.save(path)
    trained.save_weights(checkpoint)
    saved = state(trained)
    result = {"saved": saved}
    with where.scope():
        loaded = keras.models.load_model(path)
        result["loaded"] = state(loaded)
        result["loaded_specs"] = specs(loaded)
        result["resumed"] = one_more_step(loaded)
        restored = model()
        restored.compile(optimizer=optimizer(slot_dtype, True), loss="mse")
        restored.optimizer.build(restored.trainable_variables)
        restored.load_weights(checkpoint)
        result["checkpoint"] = state(restored)
        result["checkpoint_specs"] = specs(restored)
        result["checkpoint_resumed"] = one_more_step(restored)
    alone = keras.models.load_model(path)  # No distribution: one device.
    result["one_device"] = state(alone)
    result["one_device_whole"] = on_one_device(alone)
    result["one_device_resumed"] = one_more_step(alone)
    with where.scope():
        result["uninterrupted"] = one_more_step(trained)
    return result


def loop(where, shard, weights, steps=3):
    """A jitted loop over `stateless_apply`: the final state, and the
    mesh axes of the weights and slots it returns."""
    import jax

    x, y = data()
    with where.scope():
        trained = model()
        trained.set_weights(weights)
        adamw = optimizer(None, shard)
        adamw.build(trained.trainable_variables)
        batch = where.get_data_layout((8, UNITS))
        x = keras.distribution.distribute_tensor(x[:8], batch)
        y = keras.distribution.distribute_tensor(y[:8], batch)

        @jax.jit
        def step(trainable, values, x, y):
            def loss_of(trainable):
                predicted, _ = trained.stateless_call(trainable, [], x)
                return keras.ops.mean(keras.ops.square(predicted - y))

            grads = jax.grad(loss_of)(trainable)
            return adamw.stateless_apply(values, grads, trainable)

        trainable = [v.value for v in trained.trainable_variables]
        values = [v.value for v in adamw.variables]
        for _ in range(steps):
            trainable, values = step(trainable, values, x, y)
        return {
            "state": [np.asarray(v) for v in trainable + values],
            "weights": [tuple(v.sharding.spec) for v in trainable],
            "slots": [tuple(v.sharding.spec) for v in values if v.ndim == 2],
        }


def collectives(where, shard, weights):
    """`{collective: count}` in the optimized HLO of `fit`'s step, and the
    number of variables whose state is split (with `shard`)."""
    import jax

    x, y = data(8)
    with where.scope():
        trained = model()
        trained.set_weights(weights)
        trained.compile(optimizer=optimizer(None, shard), loss="mse")
        trained._symbolic_build(data_batch=(x, y))
        values = trained._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        shardings = trained._get_state_sharding_spec()
        step = jax.jit(
            trained.train_step,
            donate_argnums=0,
            out_shardings=(None, shardings),
        )
        batch = where.get_data_layout(x.shape)
        x = keras.distribution.distribute_tensor(x, batch)
        y = keras.distribution.distribute_tensor(y, batch)
        text = step.lower(values, (x, y)).compile().as_text()
    counts = collections.Counter()
    for line in text.splitlines():
        for name in COLLECTIVES:
            if re.search(rf"\b{name}(-start)?\(", line):
                counts[name] += 1
    split = sum(
        math.prod(v.shape) >= sharded_state.MIN_SHARDED_SIZE
        for v in trained.trainable_variables
    )
    return {"counts": dict(counts), "split_variables": split}


def refused(where):
    """The error for a variable none of whose axes 4 divides, and whether
    the optimizer was left as it was."""
    with where.scope():
        odd = model(units=4099, inputs=3)
        adamw = optimizer(None, True)
        before = [v.path for v in adamw.variables]
        try:
            adamw.build(odd.trainable_variables)
        except ValueError as error:
            message = str(error)
        else:
            message = None
    return {
        "message": message,
        "built": adamw.built,
        "unchanged": [v.path for v in adamw.variables] == before,
    }


def main(out_path):
    import jax

    assert len(jax.devices()) >= 4, jax.devices()
    weights = model().get_weights()
    results = {}
    for name, where in (("dp", data_parallel()), ("2x2", model_parallel())):
        for slot_dtype in SLOT_DTYPES:
            for shard in (False, True):
                trained, losses = train(where, slot_dtype, shard, weights)
                results[name, slot_dtype, shard] = record(trained, losses)
                if (name, slot_dtype, shard) == ("dp", "8bit", True):
                    with where.scope():
                        results["summary"] = kmp.summary(trained)
    where = data_parallel()
    results["skip"] = skip(where)
    with tempfile.TemporaryDirectory() as directory:
        for slot_dtype in SLOT_DTYPES:
            results["round_trip", slot_dtype] = round_trip(
                slot_dtype, where, weights, directory
            )
    for shard in (False, True):
        results["loop", shard] = loop(where, shard, weights)
        results["collectives", shard] = collectives(where, shard, weights)
    results["refused"] = refused(where)
    with open(out_path, "wb") as file:
        pickle.dump(results, file)


if __name__ == "__main__":
    main(sys.argv[1])
