"""`kmp bench` on TensorFlow: its custom loop and the train function `fit`
runs.

The custom loop is a `tf.function` around a `tf.GradientTape` (kmp:
`get_scaled_loss`, `get_unscaled_gradients`, `apply_gradients`; Keras 3's
loss-scale optimizer: gradients of `scale_loss`, which `apply_gradients`
unscales). The `fit` rows time the train function `fit` runs for every
batch (`model.make_train_function()`), fed by a distributed `tf.data`
iterator as in `fit`. Neither uses XLA (`jit_compile=False`), so both
compile alike on every machine. float16 configurations turn TensorFlow's
op fusion off on CPUs (`FLOAT16_FUSION_NOTE` in `bench.report`).
"""

import contextlib

import kmp
from kmp.core.backend import tensorflow as _tensorflow

tf = _tensorflow()


def device() -> str:
    """`"gpu"` if TensorFlow sees a GPU, else `"cpu"`."""
    return "gpu" if tf.config.list_physical_devices("GPU") else "cpu"


FULL_FLOAT32 = "float32"


@contextlib.contextmanager
def full_float32():
    """float32 matmuls and convolutions at full float32 precision while
    the benchmark runs, then the setting as it was: TensorFlow computes
    them in TF32 on NVIDIA GPUs of compute capability 8.0 and newer by
    default (`tf.config.experimental.enable_tensor_float_32_execution`)."""
    saved = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(saved)


def float32_matmuls() -> str:
    """The precision of float32 matmuls and convolutions now:
    `FULL_FLOAT32`, or TF32 where the GPU has it."""
    if tf.config.experimental.tensor_float_32_execution_enabled():
        return "TF32 allowed (TensorFlow)"
    return FULL_FLOAT32


@contextlib.contextmanager
def context(configuration):
    """The settings a configuration's steps run under, and its memory.

    TensorFlow's op fusion ('remapping') is off for float16 compute on a
    CPU: there its fused float16 MatMul + BiasAdd kernel is far slower than
    the plain ops (benchmarks/README.md), which would make float16 look far
    worse than it is; float32 and bfloat16 keep the fusion, as users get it.
    The option is read at every call, so it can change between
    configurations. On a GPU the allocator's peak during the steps, beyond
    what was allocated before them, is kept as `configuration.peak_bytes`.
    """
    options = tf.config.optimizer.get_experimental_options()
    compute = kmp.Policy(configuration.policy).compute_dtype
    on_gpu = device() == "gpu"
    if not on_gpu and compute == "float16":
        tf.config.optimizer.set_experimental_options({"remapping": False})
    if on_gpu:
        tf.config.experimental.reset_memory_stats("GPU:0")
        before = tf.config.experimental.get_memory_info("GPU:0")["current"]
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options(
            {"remapping": options.get("remapping", True)}
        )
        if on_gpu:
            peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
            configuration.note_peak_bytes(peak - before)


def make_step(configuration, batches):
    """The configuration's training step (a `fit` or a custom-loop one)."""
    if configuration.loop == "fit":
        return _FitStep(configuration, batches)
    return _CustomStep(configuration, batches)


class _Step:
    """What every step offers `bench`: `run()` returns the loss."""

    def after_block(self):
        pass

    def sync(self, loss):
        """Waits for the steps so far: reads the last loss (the device runs
        a function's ops in order, so its last one has finished too)."""
        loss.numpy()

    def value_of(self, variable):
        return variable.numpy()

    def finish(self):
        pass


class _CustomStep(_Step):
    def __init__(self, configuration, batches):
        model = configuration.model
        optimizer = configuration.optimizer
        loss_fn = configuration.loss_fn
        variables = model.trainable_variables
        # Built before tracing, so the step reads the optimizer's variables
        # (the loss scale included) rather than their initial values.
        optimizer.build(variables)
        protocol = configuration.protocol

        @tf.function(jit_compile=False)
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                if protocol == "kmp":
                    target = optimizer.get_scaled_loss(loss)
                elif protocol == "native":
                    # Keras 3's protocol: apply_gradients unscales by itself.
                    target = optimizer.scale_loss(loss)
                else:
                    target = loss
            grads = tape.gradient(target, variables)
            if protocol == "kmp":
                grads = optimizer.get_unscaled_gradients(grads)
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        self._step = step
        self._batches = batches
        self._configuration = configuration

    def run(self):
        return self._step(*self._batches.get(self._configuration.steps_run))


class _FitStep(_Step):
    def __init__(self, configuration, batches):
        # An explicit loss-scale optimizer is used as it is: kmp's own for
        # the kmp rows, Keras's for the native ones.
        self._model = model = configuration.model
        model.compile(
            optimizer=configuration.optimizer,
            loss=configuration.loss_fn,
            jit_compile=False,
            auto_scale_loss=configuration.implementation != "unscaled",
        )
        dataset = tf.data.Dataset.from_tensor_slices(
            (batches.x_numpy, batches.y_numpy)
        ).repeat()
        strategy = model.distribute_strategy
        self._iterator = iter(strategy.experimental_distribute_dataset(dataset))
        model.make_train_function()
        self._train_function = model.train_function

    def run(self):
        return self._train_function(self._iterator)["loss"]

    def after_block(self):
        # fit logs the loss averaged since the last reset: reset it so that
        # the next block's steps log theirs (`Configuration.record`).
        self._model.reset_metrics()


__all__ = ["context", "device", "make_step"]
