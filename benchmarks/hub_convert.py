"""`kmp.convert` on a compiled keras-hub task against the same recipe by hand.

A tiny `GPT2CausalLM` (built from a config, `preprocessor=None`: no
download) is compiled with the user's `AdamW(1e-3)` and converted with
`kmp.convert(task, "bfloat16", slot_dtype="8bit", seed=0)`; beside it the
same copy is compiled by hand with `kmp.LowPrecisionOptimizer(AdamW(1e-3),
slot_dtype="8bit", seed=0)`, and float32 AdamW trains the original. Each
trains `--steps` steps of next-byte prediction on Python's own standard
library sources (sequences of 16 bytes), then is scored on held-out
sequences. The converted task must train like the hand-built one (goal:
held-out loss within 2%).

    KERAS_BACKEND=jax python benchmarks/hub_convert.py [--steps 200]

Needs keras-hub (`pip install keras-hub`; without TensorFlow its `fit`
needs `grain`).
"""

import argparse
import glob
import os
import time

import keras
import numpy as np

import kmp

LENGTH = 16
HELD_OUT = 512


def _sequences(files):
    paths = sorted(
        glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))
    )
    text = b"".join(open(path, "rb").read() for path in paths[:files])
    data = np.frombuffer(text, np.uint8).astype("int32")
    count = (len(data) - 1) // (LENGTH + 1)
    sequences = data[: count * (LENGTH + 1)].reshape(count, LENGTH + 1)
    np.random.default_rng(0).shuffle(sequences)
    return sequences[:-HELD_OUT], sequences[-HELD_OUT:]


def _inputs(sequences):
    ids = sequences[:, :-1]
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
    return x, sequences[:, 1:]


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _task():
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=256,
        num_layers=1,
        num_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
        max_sequence_length=LENGTH,
    )
    task = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    task.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=_loss())
    return task


def _train(model, train, held_out, steps, batch):
    for step in range(steps):
        start = (step * batch) % (len(train) - batch)
        model.train_on_batch(*_inputs(train[start : start + batch]))
    x, y = _inputs(held_out)
    return float(model.evaluate(x, y, batch_size=128, verbose=0)[0])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--files", type=int, default=40, help="standard-library files read"
    )
    args = parser.parse_args(argv)
    train, held_out = _sequences(args.files)
    task = _task()
    converted = kmp.convert(task, "bfloat16", slot_dtype="8bit", seed=0)
    optimizer = converted.optimizer
    print(
        f"backend {keras.backend.backend()}; converted optimizer: "
        f"{type(optimizer).__name__}({type(optimizer.inner_optimizer).__name__}"
        f", learning rate {float(optimizer.learning_rate):g}, slot_dtype "
        f"{optimizer.slot_dtype!r})"
    )
    by_hand = kmp.convert(task, "bfloat16", rounding=None)
    by_hand.compile(
        optimizer=kmp.LowPrecisionOptimizer(
            keras.optimizers.AdamW(1e-3), slot_dtype="8bit", seed=0
        ),
        loss=_loss(),
    )
    losses = {}
    runs = [("converted", converted), ("hand-built", by_hand)]
    runs.append(("float32 AdamW", _task()))
    for name, model in runs:
        start = time.perf_counter()
        losses[name] = _train(
            model, train, held_out, args.steps, args.batch_size
        )
        print(
            f"{name}: held-out loss {losses[name]:.4f} after {args.steps} "
            f"steps ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    ratio = losses["converted"] / losses["hand-built"]
    print(f"converted / hand-built: {ratio:.4f}")


if __name__ == "__main__":
    main()
