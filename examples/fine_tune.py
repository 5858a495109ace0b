"""Carry a model trained in float32 over to mixed_float16 and train it further.

A mixed_float16 model stores its weights in float32, exactly like a float32
model, so weights move between the two with `get_weights` / `set_weights` (or
a saved weights file) unchanged. Only the computation changes: the copy
computes in float16, with its softmax kept in float32, and trains with a
`kmp.LossScaleOptimizer`.

    python examples/fine_tune.py

Set KMP_EXAMPLE_SMALL=1 for a run of a few seconds on a subset of the data.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from digits import build_model  # noqa: E402
from digits import load_data  # noqa: E402

import kmp  # noqa: E402

SMALL = os.environ.get("KMP_EXAMPLE_SMALL") == "1"
FLOAT32_EPOCHS = 1 if SMALL else 3
FINE_TUNE_EPOCHS = 2 if SMALL else 15


def compile_model(model: keras.Model, optimizer) -> None:
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )


def main() -> None:
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = load_data()

    # 1. A float32 model, trained briefly.
    with kmp.policy_scope("float32"):
        original = build_model()
    compile_model(original, keras.optimizers.Adam(1e-3))
    original.fit(
        x_train, y_train, batch_size=32, epochs=FLOAT32_EPOCHS, verbose=0
    )
    _, float32_accuracy = original.evaluate(x_test, y_test, verbose=0)
    print(
        f"float32 model after {FLOAT32_EPOCHS} epochs: "
        f"test accuracy {float32_accuracy:.3f}"
    )

    # 2. The same architecture under mixed_float16, with the same weights.
    with kmp.policy_scope("mixed_float16"):
        tuned = build_model()
    tuned.set_weights(original.get_weights())
    largest_change = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(original.get_weights(), tuned.get_weights())
    )
    print(
        "weights carried over:",
        [w.dtype.name for w in tuned.get_weights()][:2],
        f"largest difference {largest_change:g}",
    )
    print("fine-tuned model computes in:", tuned.layers[0].compute_dtype)
    compile_model(tuned, kmp.LossScaleOptimizer(keras.optimizers.Adam(3e-4)))
    loss_before, accuracy_before = tuned.evaluate(x_test, y_test, verbose=0)
    print(
        "mixed_float16 copy before fine-tuning: "
        f"test accuracy {accuracy_before:.3f}"
    )

    # 3. Fine-tune in mixed precision.
    tuned.fit(
        x_train, y_train, batch_size=32, epochs=FINE_TUNE_EPOCHS, verbose=0
    )
    loss_after, accuracy_after = tuned.evaluate(x_test, y_test, verbose=0)
    print(
        f"fine-tuned {FINE_TUNE_EPOCHS} epochs in mixed_float16, loss scale "
        f"{float(tuned.optimizer.loss_scale):g}, "
        f"{int(tuned.optimizer.skipped_steps)} steps skipped"
    )
    print(f"accuracy went from {accuracy_before:.3f} to {accuracy_after:.3f}")
    print(f"loss went from {loss_before:.4f} to {loss_after:.4f}")


if __name__ == "__main__":
    main()
