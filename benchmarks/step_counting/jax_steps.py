"""One training step on JAX, as `fit` and the documented loop take it.

- `fit`: Keras's train function on one batch, as `fit` calls it (the
  state in, the state out; kmp's `compile` patch checks persistent skips
  after it);
- `loop`: `examples/jax_custom_loop.py`'s jitted step (with kmp,
  `stateless_scale_loss`, `stateless_apply` of the scaled gradients with
  `scaled=True`, then `check_persistent_skips` on the new state;
  with Keras's optimizer, gradients of `scale_loss(loss)`, unscaled by its
  `stateless_apply`; with Adam, `stateless_apply`), donating the state it
  is given (`donate_argnums=0`) as the example does, so XLA may update the
  weights and slots in place.

`compiled()` counts the kernels and buffer copies of the compiled step
(`compiled`): the loop's jitted step, or `model.train_step` jitted as
Keras's `make_train_function` jits it (donating the state).
"""

import jax
import jax.numpy as jnp

from . import compiled
from . import models


class Step:
    """`run()` takes one step; `compiled()` counts its HLO's kernels."""

    def __init__(self, kind, loop, n_variables):
        x, y = models.data()
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)
        self.kind = kind
        if loop == "fit":
            self.model = models.compiled_for_fit(kind, n_variables)
            # As fit does first: the optimizer's and metrics' variables.
            self.model._symbolic_build(data_batch=(x, y))
            self.model.make_train_function()
            self.state = self.model._get_jax_state(
                trainable_variables=True,
                non_trainable_variables=True,
                optimizer_variables=True,
                metrics_variables=True,
            )
            self.run = self._fit
        else:
            self.model = models.build_model(n_variables)
            self.optimizer = models.make_optimizer(kind)
            self.optimizer.build(self.model.trainable_variables)
            self.loss_fn = jax_loss
            self._jitted = jax.jit(self._loop_step(), donate_argnums=0)
            # Copies: the first step donates them, and the variables keep
            # theirs (as the example).
            self.state = jax.tree.map(
                jnp.copy,
                (
                    [v.value for v in self.model.trainable_variables],
                    [v.value for v in self.model.non_trainable_variables],
                    [v.value for v in self.optimizer.variables],
                ),
            )
            self.run = self._loop

    def _fit(self):
        logs, self.state = self.model.train_function(
            self.state, iter([(self.x, self.y)])
        )
        return logs

    def _loop(self):
        self.state, loss = self._jitted(self.state, self.x, self.y)
        if self.kind == "kmp":
            # As the example: after every step, with the step's state.
            self.optimizer.check_persistent_skips(self.state[2])
        return loss

    def _loop_step(self):
        model, optimizer, kind = self.model, self.optimizer, self.kind

        def step(state, x, y):
            trainable, non_trainable, values = state

            def loss_of(trainable):
                y_pred, non_trainable_after = model.stateless_call(
                    trainable, non_trainable, x, training=True
                )
                loss = jax_loss(y, y_pred)
                if kind == "kmp":
                    scaled = optimizer.stateless_scale_loss(values, loss)
                elif kind == "keras":
                    scaled = optimizer.scale_loss(loss)
                else:
                    scaled = loss
                return scaled, (loss, non_trainable_after)

            (_, (loss, non_trainable)), grads = jax.value_and_grad(
                loss_of, has_aux=True
            )(trainable)
            if kind == "kmp":
                trainable, values = optimizer.stateless_apply(
                    values, grads, trainable, scaled=True
                )
            else:
                trainable, values = optimizer.stateless_apply(
                    values, grads, trainable
                )
            return (trainable, non_trainable, values), loss

        return step

    def wait(self):
        """Waits until the device has finished the steps run so far."""
        jax.block_until_ready(self.state)

    def compiled(self):
        """`compiled.hlo_kernels` of the step, as XLA compiles it here."""
        return compiled.hlo_kernels(self.hlo_text())

    def hlo_text(self):
        """The optimized HLO of the step (its state donated, as `fit`'s
        and the loop's)."""
        if hasattr(self, "_jitted"):
            lowered = self._jitted.lower(self.state, self.x, self.y)
        else:
            jitted = jax.jit(self.model.train_step, donate_argnums=0)
            lowered = jitted.lower(self.state, (self.x, self.y))
        return lowered.compile().as_text()


def jax_loss(y, y_pred):
    """Mean squared error in float32 (as Keras's "mse")."""
    import keras

    return keras.losses.mean_squared_error(y, y_pred).mean()


def update_hlo(kind, n_variables, unscale_first=False, **settings):
    """`(optimized HLO text, gradient parameter numbers)` of `kind`'s
    optimizer step alone (`stateless_apply`, jitted on the weights, the
    optimizer's values and the gradients, the first two donated), on the
    `n_variables` model: what `passes.gradient_passes` counts. For kmp
    (`settings` go to its `LossScaleOptimizer`), the gradients are those of
    the scaled loss, passed with `scaled=True`, or with `unscale_first`
    unscaled by `stateless_unscale_gradients` and passed with
    `scaled=False`."""
    import kmp

    model = models.build_model(n_variables)
    if kind == "kmp" and settings:
        import keras

        optimizer = kmp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-3), **settings
        )
    else:
        optimizer = models.make_optimizer(kind)
    optimizer.build(model.trainable_variables)
    trainable = [v.value for v in model.trainable_variables]
    values = [v.value for v in optimizer.variables]

    def update(trainable, values, grads):
        if kind != "kmp":
            return optimizer.stateless_apply(values, grads, trainable)
        if unscale_first:
            grads = optimizer.stateless_unscale_gradients(values, grads)
        return optimizer.stateless_apply(
            values, grads, trainable, scaled=not unscale_first
        )

    grads = [jnp.ones_like(t) for t in trainable]
    jitted = jax.jit(update, donate_argnums=(0, 1))
    text = jitted.lower(trainable, values, grads).compile().as_text()
    first = len(trainable) + len(values)
    return text, list(range(first, first + len(grads)))
