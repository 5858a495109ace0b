"""One training step on TensorFlow, as `fit` and the documented loop take
it.

- `fit`: Keras's train function on a `tf.data` iterator, as `fit` calls it;
- `fit-xla`: the same with `jit_compile=True` (Keras's default on a GPU);
- `loop`: the `tf.function` GradientTape step of `docs/training.md` (with
  kmp, `get_scaled_loss`, `get_unscaled_gradients`, `apply_gradients`;
  with Keras's optimizer, gradients of `scale_loss(loss)` given to
  `apply_gradients`, which unscales; with Adam, `apply_gradients`),
  without the docs' `clip_by_global_norm`, which is the user's.

`compiled()` counts the ops of the step's graph (`compiled.tf_graph_ops`)
and, when the step is XLA-compiled, its HLO's kernels.
"""

import tensorflow as tf

from . import compiled
from . import models


class Step:
    """`run()` takes one step; `compiled()` counts its graph's ops."""

    def __init__(self, kind, loop, n_variables):
        x, y = models.data()
        self.x, self.y = tf.constant(x), tf.constant(y)
        self.kind = kind
        if loop in ("fit", "fit-xla"):
            self.model = models.compiled_for_fit(
                kind, n_variables, jit_compile=loop == "fit-xla"
            )
            # As fit does first: the optimizer's and metrics' variables.
            self.model._symbolic_build(data_batch=(x, y))
            self.model.make_train_function()
            dataset = tf.data.Dataset.from_tensors((self.x, self.y))
            self.iterator = iter(dataset.repeat())
            self.run = self._fit
        else:
            self.model = models.build_model(n_variables)
            self.optimizer = models.make_optimizer(kind)
            self._function = tf.function(self._loop_step())
            self.run = self._loop

    def _fit(self):
        return self.model.train_function(self.iterator)

    def _loop(self):
        return self._function(self.x, self.y)

    def _loop_step(self):
        import keras

        model, optimizer, kind = self.model, self.optimizer, self.kind
        loss_fn = keras.losses.MeanSquaredError()

        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                if kind == "kmp":
                    scaled = optimizer.get_scaled_loss(loss)
                elif kind == "keras":
                    scaled = optimizer.scale_loss(loss)
                else:
                    scaled = loss
            grads = tape.gradient(scaled, model.trainable_variables)
            if kind == "kmp":
                grads = optimizer.get_unscaled_gradients(grads)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return train_step

    def wait(self):
        """Waits until the steps run so far have finished (a weight's
        value, read on the host, is the last step's)."""
        self.model.trainable_variables[0].numpy()

    def compiled(self):
        """`compiled.tf_graph_ops` of the step (Keras's `train_step` for
        `fit`), plus `hlo` when it is XLA-compiled."""
        if hasattr(self, "_function"):
            function, args, jit = self._function, (self.x, self.y), False
        else:
            # Keras's train_step on the same batch, as its train function
            # compiles it.
            jit = bool(self.model.jit_compile)
            function = tf.function(self.model.train_step, jit_compile=jit)
            args = ((self.x, self.y),)
        counts = compiled.tf_graph_ops(function.get_concrete_function(*args))
        if jit:
            text = function.experimental_get_compiler_ir(*args)(
                stage="optimized_hlo"
            )
            counts["hlo"] = compiled.hlo_kernels(text)
        return counts


def update_hlo(kind, n_variables, protocol="loop"):
    """`(optimized HLO text, gradient parameter numbers)` of `kind`'s
    optimizer step alone, compiled by XLA on the gradients (the function's
    first arguments: parameters 0 to n - 1) on the `n_variables` model:
    what `passes.gradient_passes` counts. `protocol` "loop" takes it as the
    documented loop does (kmp: `get_unscaled_gradients`, then
    `apply_gradients`; Keras's optimizer unscales in `apply_gradients`),
    "fit" as Keras's train step does (the gradients of the scaled loss
    given to `apply`, which unscales them)."""
    model = models.build_model(n_variables)
    optimizer = models.make_optimizer(kind)
    variables = model.trainable_variables
    optimizer.build(variables)
    grads = [tf.ones(v.shape, v.dtype) for v in variables]

    @tf.function(jit_compile=True)
    def update(grads):
        if protocol == "fit":
            if kind != "plain":  # As Keras's train step scales the loss.
                optimizer.scale_loss(tf.constant(1.0))
            optimizer.apply(grads, variables)
            return
        if kind == "kmp":
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, variables))

    text = update.experimental_get_compiler_ir(grads)(stage="optimized_hlo")
    return text, list(range(len(grads)))
