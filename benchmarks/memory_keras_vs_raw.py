"""Training memory of the MLP in Keras 3 against the same math in raw TF.

Runs one configuration per process (this script re-runs itself): the
784-4096-4096-10 MLP at batch 8192 under float32 or mixed_bfloat16, built
either from Keras layers or from plain `tf.Variable`s and `tf.matmul` with
one cast per weight. It reports TensorFlow's own allocator peak
(`tf.config.experimental.get_memory_info("CPU:0")`) during three Adam steps
minus what was allocated before them (weights, slots, data), then the
bf16 / float32 ratios. Peak resident memory (VmHWM) is also printed: it is
what the operating system sees, but it varies by hundreds of MB between
runs of the same configuration, while the allocator's peak counts tensor
bytes. The gap between the two bfloat16 rows is what Keras's layers keep
beyond the math itself.

    python benchmarks/memory_keras_vs_raw.py
"""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

BATCH, UNITS = 8192, 4096


def _status(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _measure(kind, policy):
    import keras
    import tensorflow as tf

    x = tf.random.normal((BATCH, 784))
    y = tf.random.uniform((BATCH,), 0, 10, tf.int32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "keras":
        keras.config.set_dtype_policy(policy)
        model = keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(UNITS, activation="relu"),
                keras.layers.Dense(UNITS, activation="relu"),
                keras.layers.Dense(10, dtype="float32"),
            ]
        )
        variables = model.trainable_variables
        forward = model
    else:
        compute = tf.bfloat16 if policy == "mixed_bfloat16" else tf.float32
        shapes = [(784, UNITS), (UNITS,), (UNITS, UNITS), (UNITS,)]
        shapes += [(UNITS, 10), (10,)]
        variables = [tf.Variable(tf.random.normal(s) * 0.01) for s in shapes]

        def forward(inputs):
            hidden = tf.cast(inputs, compute)
            for i in (0, 2):
                kernel = tf.cast(variables[i], compute)
                bias = tf.cast(variables[i + 1], compute)
                hidden = tf.nn.relu(tf.matmul(hidden, kernel) + bias)
            hidden = tf.cast(hidden, tf.float32)
            return tf.matmul(hidden, variables[4]) + variables[5]

    optimizer = keras.optimizers.Adam()
    optimizer.build(variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, forward(x))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    step.get_concrete_function()
    tf.config.experimental.reset_memory_stats("CPU:0")
    allocated = tf.config.experimental.get_memory_info("CPU:0")["current"]
    resident = _status("VmRSS")
    for _ in range(3):
        step().numpy()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    print((peak - allocated) / 2**20, _status("VmHWM") - resident)


def main():
    if len(sys.argv) == 3:
        _measure(*sys.argv[1:])
        return
    results = {}
    for kind in ("keras", "raw"):
        for policy in ("float32", "mixed_bfloat16"):
            output = subprocess.run(
                [sys.executable, __file__, kind, policy],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            allocator, resident = map(
                float, output.strip().splitlines()[-1].split()
            )
            results[kind, policy] = allocator
            print(
                f"{kind:5s} {policy:14s} allocator peak {allocator:7.1f} MB "
                f"beyond what was allocated before (peak RSS {resident:.0f} "
                "MB beyond)"
            )
    for kind in ("keras", "raw"):
        ratio = results[kind, "mixed_bfloat16"] / results[kind, "float32"]
        print(f"{kind:5s} bf16 / float32: {ratio:.2f}x")


if __name__ == "__main__":
    main()
