"""Why Keras 3's LSTM gains little from bfloat16: casts inside the time loop.

Traces `keras.layers.LSTM(256)` on a (64, 64, 32) batch under a policy and
counts the Cast, ReadVariableOp and MatMul ops in the traced graph and in
each function it calls (the `while` loop over time steps is one of them).
Under mixed_bfloat16 the loop body reads the kernel, recurrent kernel and
bias and casts them to bfloat16 again at every one of the 64 time steps.

It then traces a training step (forward and gradient) three ways: Keras's own
loop, with kmp's `recurrent` patch (`kmp.patches.install("recurrent")`: the
weights cast once per call, before the loop; results bit-identical), and with
it and `kmp.patches.recurrent.set_exact(False)` (the loop's gradient for the
weights summed in bfloat16, as tf.keras did). The
TensorListPushBack ops are the tensors the forward loop keeps for the backward
pass, one per step each.

    python benchmarks/diagnostics/lstm_graph.py [--policy mixed_bfloat16]
"""

import argparse
import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmp  # noqa: E402
from kmp.patches import recurrent  # noqa: E402

COUNTED = ("Cast", "ReadVariableOp", "MatMul", "TensorListPushBack")


def _print_op_counts(graph, depth=0):
    counts = collections.Counter(op.type for op in graph.get_operations())
    shown = ", ".join(f"{name} {counts[name]}" for name in COUNTED)
    print(f"{'  ' * depth}{graph.name}: {shown}")
    for function in graph._functions.values():
        if hasattr(function, "graph"):
            _print_op_counts(function.graph, depth + 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", default="mixed_bfloat16")
    args = parser.parse_args()
    kmp.set_global_policy(args.policy)
    kmp.patches.uninstall("recurrent")
    layer = keras.layers.LSTM(256)
    inputs = tf.random.normal((64, 64, 32))
    layer.build(inputs.shape)
    graph = tf.function(layer).get_concrete_function(inputs).graph
    print(f"keras.layers.LSTM(256) under {args.policy}, forward:")
    _print_op_counts(graph)

    def train_step(inputs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(layer(inputs), "float32"))
        return tape.gradient(loss, layer.trainable_variables)

    for title, exact in (
        ("Keras's loop", None),
        ("kmp's recurrent patch", True),
        ("kmp's recurrent patch, set_exact(False)", False),
    ):
        if exact is None:
            kmp.patches.uninstall("recurrent")
        else:
            kmp.patches.install("recurrent")
            recurrent.set_exact(exact)
        graph = tf.function(train_step).get_concrete_function(inputs).graph
        print(f"\nTraining step (forward and gradient), {title}:")
        _print_op_counts(graph)
    recurrent.set_exact(True)


if __name__ == "__main__":
    main()
