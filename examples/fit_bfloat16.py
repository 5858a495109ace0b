"""Train a digit classifier with `model.fit` under the mixed_bfloat16 policy.

bfloat16 has the range of float32, so it needs no loss scaling: set the policy,
keep the output layer in float32, and compile and fit as usual. On CPUs with
AVX-512 BF16 or AMX, and on TPUs and recent GPUs, it is also faster than
float32.

    python examples/fit_bfloat16.py

Set KMP_EXAMPLE_SMALL=1 for a run of a few seconds on a subset of the data.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
from digits import build_model  # noqa: E402
from digits import load_data  # noqa: E402

import kmp  # noqa: E402

SMALL = os.environ.get("KMP_EXAMPLE_SMALL") == "1"
EPOCHS = 2 if SMALL else 30


def main() -> None:
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = load_data()
    kmp.set_global_policy("mixed_bfloat16")
    model = build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    print("policy:", kmp.global_policy().name)
    print("hidden layers compute in:", model.layers[0].compute_dtype)
    print("kernel dtype:", model.layers[0].kernel.dtype)
    print("output dtype:", model(x_test[:1]).dtype.name)
    # No loss scaling under bfloat16: the optimizer is Adam itself.
    print("optimizer:", type(model.optimizer).__name__)

    loss_before, accuracy_before = model.evaluate(x_test, y_test, verbose=0)
    model.fit(x_train, y_train, batch_size=32, epochs=EPOCHS, verbose=0)
    loss_after, accuracy_after = model.evaluate(x_test, y_test, verbose=0)
    print(
        f"trained {EPOCHS} epochs on {len(x_train)} digits, "
        f"tested on {len(x_test)}"
    )
    print(f"accuracy went from {accuracy_before:.3f} to {accuracy_after:.3f}")
    print(f"loss went from {loss_before:.4f} to {loss_after:.4f}")


if __name__ == "__main__":
    main()
