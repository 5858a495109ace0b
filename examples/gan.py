"""A small GAN under mixed_float16, each network with its own loss scale.

The data is generated: points from a mixture of eight Gaussians on a circle.
The generator maps noise to points, the discriminator tells real points from
generated ones, and they train against each other in a custom loop: on every
step each network takes one step on its own loss.

A GAN has two losses and two optimizers, so it needs two loss scales: the
discriminator's and the generator's gradients have different sizes and
overflow at different times. Each network therefore gets its own
`kmp.LossScaleOptimizer`; an overflow in one network's step skips that step
and lowers that scale only. Switches that turn on float16 for "the" model,
"the" loss and "the" optimizer in one call have no place for the second
network.

    python examples/gan.py

Set KMP_EXAMPLE_SMALL=1 for a run of a few seconds.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmp  # noqa: E402

SMALL = os.environ.get("KMP_EXAMPLE_SMALL") == "1"
STEPS = 150 if SMALL else 2000
REPORT_EVERY = 50 if SMALL else 250
# float16 is emulated on most CPUs and much slower than float32 there: the
# networks are kept small so that the example runs in well under a minute.
BATCH_SIZE = 64
WIDTH = 64
# Growth every 200 finite steps instead of 2000 makes each scale move (and
# overflow now and then) within this short run.
GROWTH_STEPS = 25 if SMALL else 200
NOISE_SIZE = 8
MODES = 8
RADIUS = 2.0
MODE_STD = 0.05
CENTERS = np.stack(
    [
        RADIUS * np.cos(2 * np.pi * np.arange(MODES) / MODES),
        RADIUS * np.sin(2 * np.pi * np.arange(MODES) / MODES),
    ],
    axis=1,
).astype("float32")


def real_points(rng: np.random.Generator, count: int) -> np.ndarray:
    centers = CENTERS[rng.integers(0, MODES, count)]
    noise = rng.normal(0.0, MODE_STD, size=(count, 2))
    return (centers + noise).astype("float32")


def build_generator() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((NOISE_SIZE,)),
            keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(2, dtype="float32"),  # points, in float32
        ],
        name="generator",
    )


def build_discriminator() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(WIDTH, activation="leaky_relu"),
            keras.layers.Dense(WIDTH, activation="leaky_relu"),
            keras.layers.Dense(1, dtype="float32"),  # logits, in float32
        ],
        name="discriminator",
    )


def sample_quality(generator, count: int = 2000):
    """Mean distance to the nearest mode, and how many modes are hit.

    A mode counts as hit when at least 2% of the points lie within 4 standard
    deviations of its center.
    """
    points = generator(tf.random.normal((count, NOISE_SIZE))).numpy()
    distances = np.linalg.norm(points[:, None, :] - CENTERS[None], axis=-1)
    nearest = distances.argmin(axis=1)
    close = distances.min(axis=1) < 4 * MODE_STD
    hits = np.bincount(nearest[close], minlength=MODES)
    return float(distances.min(axis=1).mean()), int(
        (hits >= 0.02 * count).sum()
    )


def main() -> None:
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    kmp.set_global_policy("mixed_float16")
    generator = build_generator()
    discriminator = build_discriminator()
    g_optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3, beta_1=0.5),
        dynamic_growth_steps=GROWTH_STEPS,
    )
    d_optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3, beta_1=0.5),
        dynamic_growth_steps=GROWTH_STEPS,
    )
    bce = keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def train_step(real):
        noise = tf.random.normal((BATCH_SIZE, NOISE_SIZE))
        with tf.GradientTape(persistent=True) as tape:
            fake = generator(noise, training=True)
            real_logits = discriminator(real, training=True)
            fake_logits = discriminator(fake, training=True)
            d_loss = bce(tf.ones_like(real_logits), real_logits) + bce(
                tf.zeros_like(fake_logits), fake_logits
            )
            g_loss = bce(tf.ones_like(fake_logits), fake_logits)
            # Each loss is scaled by its own optimizer, inside the tape.
            d_scaled = d_optimizer.get_scaled_loss(d_loss)
            g_scaled = g_optimizer.get_scaled_loss(g_loss)
        d_vars = discriminator.trainable_variables
        g_vars = generator.trainable_variables
        d_grads = d_optimizer.get_unscaled_gradients(
            tape.gradient(d_scaled, d_vars)
        )
        g_grads = g_optimizer.get_unscaled_gradients(
            tape.gradient(g_scaled, g_vars)
        )
        del tape
        d_optimizer.apply_gradients(zip(d_grads, d_vars))
        g_optimizer.apply_gradients(zip(g_grads, g_vars))
        return d_loss, g_loss

    distance_before, modes_before = sample_quality(generator)
    for step in range(1, STEPS + 1):
        d_loss, g_loss = train_step(real_points(rng, BATCH_SIZE))
        if step % REPORT_EVERY == 0:
            print(
                f"step {step}: discriminator loss {float(d_loss):.4f}, "
                f"generator loss {float(g_loss):.4f}, "
                f"discriminator scale {float(d_optimizer.loss_scale):g}, "
                f"generator scale {float(g_optimizer.loss_scale):g}"
            )
    distance_after, modes_after = sample_quality(generator)
    for name, optimizer in (
        ("discriminator", d_optimizer),
        ("generator", g_optimizer),
    ):
        print(
            f"{name}: loss scale {float(optimizer.loss_scale):g}, "
            f"{int(optimizer.iterations)} steps applied, "
            f"{int(optimizer.skipped_steps)} skipped"
        )
    print(f"modes covered went from {modes_before} to {modes_after} of {MODES}")
    print(
        f"distance to the nearest mode went from {distance_before:.4f} "
        f"to {distance_after:.4f}"
    )


if __name__ == "__main__":
    main()
