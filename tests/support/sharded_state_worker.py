"""The process of tests/core/test_low_precision_sharded.py: quantized
optimizer state under `keras.distribution.ModelParallel` on 4 host devices.

Not a test module. Started as

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python tests/support/sharded_state_worker.py OUT.pkl

it trains a 2-layer MLP of 256x256 kernels with `kmp.LowPrecisionOptimizer`
(8-bit and 4-bit AdamW state) sharded by a `LayoutMap` on either kernel axis
of a 4-device "model" mesh and on a 2x2 ("batch", "model") mesh, beside the
same training on one device and float32 AdamW under the same layouts, and
records in OUT.pkl (a dict) what the test checks: the optimizer state's
bytes on each device, the variables after training, the codes' and scales'
shardings, a `.keras` round trip under the distribution, the errors for
layouts that cannot shard a slot, and `kmp.summary`'s lines.
"""

import os
import pickle
import sys
import tempfile

import keras
import numpy as np

import kmp

ops = keras.ops
UNITS = 256
STEPS = 3
# Kernel layouts by name: (mesh shape, mesh axes, the kernels' axes).
LAYOUTS = {
    "columns": ((4,), ("model",), (None, "model")),
    "rows": ((4,), ("model",), ("model", None)),
    "2x2": ((2, 2), ("batch", "model"), (None, "model")),
}
SLOT_DTYPES = ("8bit", "4bit")


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, UNITS)).astype("float32")
    y = rng.normal(size=(32, UNITS)).astype("float32")
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


def optimizer(slot_dtype, **kwargs):
    inner = keras.optimizers.AdamW(1e-2, weight_decay=0.01)
    if slot_dtype is None:
        return inner
    return kmp.LowPrecisionOptimizer(
        inner, slot_dtype=slot_dtype, seed=1, **kwargs
    )


def distribution(name, kernel=None):
    shape, axes, kernel_axes = LAYOUTS[name]
    import jax  # Optional: pytest's doctest collection imports this module.

    mesh = keras.distribution.DeviceMesh(shape, axes, jax.devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = kernel or kernel_axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=axes[0]
    )


def per_device_bytes(variables):
    """The largest number of bytes of `variables` on one device."""
    totals = {}
    for variable in variables:
        for shard in variable.value.addressable_shards:
            totals[shard.device] = (
                totals.get(shard.device, 0) + shard.data.nbytes
            )
    return max(totals.values())


def state(trained):
    """`[(dtype, value), ...]` of the weights and the optimizer's variables,
    in order (paths differ between models)."""
    variables = trained.trainable_variables + trained.optimizer.variables
    return [(v.dtype, np.asarray(v.value)) for v in variables]


def shardings(trained, kernel):
    """The mesh axes of the first kernel's and of its quantized slots'
    variables (None: no layout)."""
    base = kernel.path.replace("/", "_")
    found = {"kernel": tuple(kernel.value.sharding.spec)}
    for variable in trained.optimizer.variables:
        if variable.path.split("/")[-1].startswith(base):
            spec = tuple(variable.value.sharding.spec)
            found[variable.path.split("/")[-1][len(base) + 1 :]] = spec
    return found


def train(slot_dtype, where, weights):
    """Trains from `weights` under `where` (a distribution or None);
    returns the model."""
    x, y = data()
    scope = where.scope() if where else _nothing()
    with scope:
        trained = model()
        trained.set_weights(weights)
        trained.compile(optimizer=optimizer(slot_dtype), loss="mse")
        trained.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return trained


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def round_trip(trained, where, directory):
    """Saves `trained`, loads it under `where`; the loaded model's state,
    codes' shardings, and both after one more step each."""
    path = os.path.join(directory, "sharded.keras")
    trained.save(path)
    x, y = data()
    with where.scope():
        loaded = keras.models.load_model(path)
        result = {
            "loaded": state(loaded),
            "shardings": shardings(loaded, loaded.layers[0].kernel),
        }
        for each in (trained, loaded):
            each.fit(x[:8], y[:8], batch_size=8, shuffle=False, verbose=0)
    result["resumed"] = state(loaded)
    result["uninterrupted"] = state(trained)
    return result


def error_of(make_model, slot_dtype, where, **kwargs):
    try:
        with where.scope():
            built = make_model()
            built.compile(optimizer=optimizer(slot_dtype, **kwargs), loss="mse")
            built.optimizer.build(built.trainable_variables)
    except ValueError as error:
        return str(error)
    return None


def main(out_path):
    import jax

    assert len(jax.devices()) >= 4, jax.devices()
    weights = model().get_weights()
    results = {"bytes": {}, "equal": {}, "shardings": {}}
    for name in LAYOUTS:
        where = distribution(name)
        adamw = train(None, where, weights)
        results["bytes"][(name, None)] = per_device_bytes(
            adamw.optimizer.variables
        )
        results["equal"][(name, None)] = state(adamw)
        for slot_dtype in SLOT_DTYPES:
            sharded = train(slot_dtype, where, weights)
            results["bytes"][(name, slot_dtype)] = per_device_bytes(
                sharded.optimizer.variables
            )
            results["shardings"][(name, slot_dtype)] = shardings(
                sharded, sharded.layers[0].kernel
            )
            results["equal"][(name, slot_dtype)] = state(sharded)
            if name == "columns":
                with where.scope():
                    results["summary", slot_dtype] = kmp.summary(sharded)
                with tempfile.TemporaryDirectory() as directory:
                    results["round_trip", slot_dtype] = round_trip(
                        sharded, where, directory
                    )
    for slot_dtype in (None, *SLOT_DTYPES):
        results["one_device", slot_dtype] = state(
            train(slot_dtype, None, weights)
        )
    where = distribution("columns")
    # 300 columns: blocks of 256 run across the rows.
    results["error", "rows"] = error_of(
        lambda: model(units=300, inputs=16), "8bit", where
    )
    # 4 columns, one on each device: 4-bit byte pairs would span two.
    results["error", "pairs"] = error_of(
        lambda: model(units=4, inputs=1024), "4bit", where
    )
    with open(out_path, "wb") as file:
        pickle.dump(results, file)


if __name__ == "__main__":
    main(sys.argv[1])
