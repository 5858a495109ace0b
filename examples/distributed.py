"""mixed_float16 with tf.distribute.MirroredStrategy, in fit and in a loop.

The script splits the CPU into two logical devices, so that it shows data
parallelism on any machine; on a machine with GPUs, pass their names to
MirroredStrategy instead. Each replica computes gradients on its half of the
batch; kmp's LossScaleOptimizer sums them across replicas, checks the sum for
inf and NaN, and every replica applies (or skips) the step together.

    python examples/distributed.py

Set KMP_EXAMPLE_SMALL=1 for a run of a few seconds on a subset of the data.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

# Devices must be configured before anything initialises TensorFlow's
# runtime, hence before building any model.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
from digits import build_model  # noqa: E402
from digits import load_data  # noqa: E402

import kmp  # noqa: E402

SMALL = os.environ.get("KMP_EXAMPLE_SMALL") == "1"
EPOCHS = 2 if SMALL else 10
GLOBAL_BATCH_SIZE = 64  # 32 per replica


def train_with_fit(strategy, data) -> None:
    (x_train, y_train), (x_test, y_test) = data
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    loss_before, _ = model.evaluate(x_test, y_test, verbose=0)
    model.fit(
        x_train,
        y_train,
        batch_size=GLOBAL_BATCH_SIZE,
        epochs=EPOCHS,
        verbose=0,
    )
    loss_after, accuracy = model.evaluate(x_test, y_test, verbose=0)
    optimizer = model.optimizer
    print(
        f"fit: {int(optimizer.iterations.numpy())} steps, "
        f"{int(optimizer.skipped_steps)} skipped, "
        f"loss scale {float(optimizer.loss_scale):g}, "
        f"test accuracy {accuracy:.3f}"
    )
    print(f"fit: loss went from {loss_before:.4f} to {loss_after:.4f}")


def train_with_loop(strategy, data) -> None:
    (x_train, y_train), (x_test, y_test) = data
    with strategy.scope():
        model = build_model()
        optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
        # Keras optimizers create their slot variables when built; under a
        # strategy that must happen here, not inside the first distributed
        # step (fit does the same by itself).
        optimizer.build(model.trainable_variables)
    # Per-example losses, averaged over the global batch below, so that the
    # gradients summed over the replicas are those of the whole batch.
    per_example_loss = keras.losses.SparseCategoricalCrossentropy(
        reduction=None
    )
    dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=0)
        .batch(GLOBAL_BATCH_SIZE, drop_remainder=True)
    )
    dataset = strategy.experimental_distribute_dataset(dataset)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            losses = per_example_loss(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(
                losses, global_batch_size=GLOBAL_BATCH_SIZE
            )
            scaled_loss = optimizer.get_scaled_loss(loss)
        variables = model.trainable_variables
        scaled_grads = tape.gradient(scaled_loss, variables)
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    @tf.function
    def train_step(x, y):
        per_replica = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, None)

    def test_loss() -> float:
        losses = per_example_loss(y_test, model(x_test))
        return float(tf.reduce_mean(losses))

    loss_before = test_loss()
    for _ in range(EPOCHS):
        for x, y in dataset:
            train_step(x, y)
    loss_after = test_loss()
    print(
        f"custom loop: {int(optimizer.iterations.numpy())} steps, "
        f"{int(optimizer.skipped_steps)} skipped, "
        f"loss scale {float(optimizer.loss_scale):g}"
    )
    print(f"custom loop: loss went from {loss_before:.4f} to {loss_after:.4f}")


def main() -> None:
    keras.utils.set_random_seed(0)
    kmp.set_global_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    print("replicas in sync:", strategy.num_replicas_in_sync)
    data = load_data(small_size=384)  # A multiple of the global batch.
    train_with_fit(strategy, data)
    train_with_loop(strategy, data)


if __name__ == "__main__":
    main()
