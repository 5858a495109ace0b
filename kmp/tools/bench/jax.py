"""`kmp bench` on JAX: the jitted loop the README writes, and `fit`'s step.

The custom loop is the one Keras documents for JAX and kmp's README shows
(`examples/jax_custom_loop.py`): `jax.value_and_grad` over
`model.stateless_call`, then `optimizer.stateless_apply`, in one `jax.jit`,
with the state passed in and out. kmp scales the loss with
`stateless_scale_loss`, unscales with `stateless_unscale_gradients`, applies
with `stateless_apply(..., scaled=False)` and calls
`check_persistent_skips(optimizer_values)` after every step, as the README
does; Keras 3's loss-scale optimizer scales with `scale_loss` (reading the
scale from the state, as Keras's trainer does) and its `stateless_apply`
unscales. The `fit` rows time the jitted train function `fit` runs for every
batch (`model.make_train_function()`), with the state `fit` holds between
steps, on batches already on the device.

Compiled steps are kept in JAX's persistent compilation cache
(`enable_compilation_cache`), so that a second run compiles less.

With `memory`, a configuration's `peak_bytes` is what XLA allocates for one
step of the compiled function: its arguments, outputs and temporaries,
less the donated buffers (`memory_analysis()` of the compiled step).
"""

import contextlib
import os

import jax
import numpy as np
from keras.src.backend.common.stateless_scope import StatelessScope


def device() -> str:
    """`"gpu"` if JAX computes on a GPU, else `"cpu"`."""
    return "gpu" if jax.default_backend() == "gpu" else "cpu"


def compilation_cache_dir() -> str:
    """Where `kmp bench` keeps JAX's compiled steps by default:
    `$KMP_JAX_CACHE_DIR`, else `kmp/jax` in `$XDG_CACHE_HOME` (else
    `~/.cache`)."""
    if os.environ.get("KMP_JAX_CACHE_DIR"):
        return os.environ["KMP_JAX_CACHE_DIR"]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(root, "kmp", "jax")


def enable_compilation_cache(directory=None) -> str:
    """Turns JAX's persistent compilation cache on, in `directory` (None:
    `compilation_cache_dir()`), unless JAX was given a folder already
    (`jax_compilation_cache_dir`): that one is kept. Returns the folder.

    JAX keeps only compilations that took a second or more (its
    `jax_persistent_cache_min_compile_time_secs`), so tiny models leave
    the folder alone.
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    directory = directory or compilation_cache_dir()
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    return directory


def full_float32():
    """float32 matmuls and convolutions at full float32 precision while
    the benchmark runs (`jax.default_matmul_precision("float32")`, read
    when a step is traced): on NVIDIA GPUs of compute capability 8.0 and
    newer JAX computes them in TF32 by default, which would make the
    float32 baseline a reduced-precision one."""
    return jax.default_matmul_precision(FULL_FLOAT32)


def float32_matmuls() -> str:
    """The precision of float32 matmuls and convolutions now:
    `FULL_FLOAT32`, or what JAX was set to (`"default"`: TF32 on recent
    NVIDIA GPUs)."""
    precision = jax.config.jax_default_matmul_precision or "default"
    return FULL_FLOAT32 if precision in _FULL else f"{precision} (JAX)"


FULL_FLOAT32 = "float32"
_FULL = (FULL_FLOAT32, "highest")


def context(configuration):
    """Nothing to set per configuration on JAX."""
    return contextlib.nullcontext()


def make_step(configuration, batches):
    """The configuration's training step (a `fit` or a custom-loop one)."""
    if configuration.loop == "fit":
        return _FitStep(configuration, batches)
    return _CustomStep(configuration, batches)


def _compiled_bytes(compiled):
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )


class _Step:
    """State held between steps; `run()` returns the loss."""

    def __init__(self, configuration, batches):
        self._configuration = configuration
        self._batches = batches
        self._positions = None

    def after_block(self):
        pass

    def sync(self, loss):
        """Waits for the steps so far: `block_until_ready` on the last
        loss and the state."""
        jax.block_until_ready((loss, self._state))

    def value_of(self, variable):
        """An optimizer variable's value in the state, as NumPy."""
        if self._positions is None:  # Once the optimizer is built.
            variables = self._configuration.optimizer.variables
            self._positions = {id(v): i for i, v in enumerate(variables)}
        return np.asarray(self._state[2][self._positions[id(variable)]])

    def finish(self):
        """Writes the state into the model's and optimizer's variables."""
        model = self._configuration.model
        optimizer = self._configuration.optimizer
        trainable, non_trainable, optimizer_values = self._state[:3]
        pairs = [
            *zip(model.trainable_variables, trainable),
            *zip(model.non_trainable_variables, non_trainable),
            *zip(optimizer.variables, optimizer_values),
        ]
        for variable, value in pairs:
            variable.assign(value)


class _CustomStep(_Step):
    def __init__(self, configuration, batches):
        super().__init__(configuration, batches)
        model = configuration.model
        optimizer = configuration.optimizer
        loss_fn = configuration.loss_fn
        optimizer.build(model.trainable_variables)
        protocol = configuration.protocol
        self._checks = protocol == "kmp"

        def step(state, x, y):
            trainable, non_trainable, optimizer_values = state

            def loss_of(trainable):
                y_pred, non_trainable_after = model.stateless_call(
                    trainable, non_trainable, x, training=True
                )
                loss = loss_fn(y, y_pred)
                if protocol == "kmp":
                    scaled = optimizer.stateless_scale_loss(
                        optimizer_values, loss
                    )
                elif protocol == "native":
                    mapping = zip(optimizer.variables, optimizer_values)
                    with StatelessScope(state_mapping=list(mapping)):
                        scaled = optimizer.scale_loss(loss)
                else:
                    scaled = loss
                return scaled, (loss, non_trainable_after)

            (_, (loss, non_trainable)), grads = jax.value_and_grad(
                loss_of, has_aux=True
            )(trainable)
            if protocol == "kmp":
                grads = optimizer.stateless_unscale_gradients(
                    optimizer_values, grads
                )
                trainable, optimizer_values = optimizer.stateless_apply(
                    optimizer_values, grads, trainable, scaled=False
                )
            else:
                trainable, optimizer_values = optimizer.stateless_apply(
                    optimizer_values, grads, trainable
                )
            return (trainable, non_trainable, optimizer_values), loss

        self._jitted = jax.jit(step)
        self._state = (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        )
        if configuration.memory:
            # Compiled ahead of time, once: the step runs this executable.
            self._jitted = self._jitted.lower(
                self._state, *batches.get(0)
            ).compile()
            configuration.note_peak_bytes(_compiled_bytes(self._jitted))

    def run(self):
        x, y = self._batches.get(self._configuration.steps_run)
        self._state, loss = self._jitted(self._state, x, y)
        if self._checks:  # As the README's loop: after every step.
            self._configuration.optimizer.check_persistent_skips(self._state[2])
        return loss


class _FitStep(_Step):
    def __init__(self, configuration, batches):
        super().__init__(configuration, batches)
        model = self._model = configuration.model
        # An explicit loss-scale optimizer is used as it is: kmp's own for
        # the kmp rows, Keras's for the native ones.
        model.compile(
            optimizer=configuration.optimizer,
            loss=configuration.loss_fn,
            auto_scale_loss=configuration.implementation != "unscaled",
        )
        model._symbolic_build(data_batch=batches.get(0))
        model.make_train_function()
        self._train_function = model.train_function
        # What fit holds between steps (the step donates it: the variables'
        # own buffers are left alone).
        self._state = jax.tree.map(
            lambda value: jax.numpy.array(value, copy=True),
            model._get_jax_state(
                trainable_variables=True,
                non_trainable_variables=True,
                optimizer_variables=True,
                metrics_variables=True,
            ),
        )
        self._fresh_metrics = [v.value for v in model.metrics_variables]
        if configuration.memory:
            # fit's step compiled once more, for XLA's account of it.
            train_step = jax.jit(model.train_step, donate_argnums=0)
            compiled = train_step.lower(self._state, batches.get(0)).compile()
            configuration.note_peak_bytes(_compiled_bytes(compiled))

    def run(self):
        data = self._batches.get(self._configuration.steps_run)
        logs, self._state = self._train_function(self._state, iter([data]))
        return logs["loss"]

    def after_block(self):
        # fit logs the loss averaged since the last reset: start the next
        # block's average afresh (`Configuration.record`).
        self._state = (
            *self._state[:3],
            [jax.numpy.zeros_like(v) for v in self._fresh_metrics],
        )


__all__ = [
    "compilation_cache_dir",
    "context",
    "device",
    "enable_compilation_cache",
    "make_step",
]
