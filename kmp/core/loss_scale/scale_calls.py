"""The scaling half of `LossScaleOptimizer`: what a training loop calls to
scale the loss and unscale the gradients.

Two recipes, by the names users know (`kmp.core.loss_scale.recipes` tells them
apart): Keras 3's `scale_loss` (which `fit` calls; `apply_gradients` then
unscales) and `tf.keras`'s `get_scaled_loss` with `get_unscaled_gradients`. On
JAX, `stateless_scale_loss` and `stateless_unscale_gradients` take the scale
from the optimizer values a step is given, for loops over `stateless_apply`; the
stateful calls refuse to run inside `jax.jit`, where the scale they read would
be a constant of the compiled step (`kmp.core.loss_scale.jax_tracing`). The
arithmetic is `kmp.core.loss_scale.scaling`'s.
"""

from typing import Iterable
from typing import List

import keras

from kmp.core import checks
from kmp.core.loss_scale import arguments
from kmp.core.loss_scale import recipes
from kmp.core.loss_scale import scaling
from kmp.core.loss_scale import shared_step as common


class ScalingMixin:
    """The scaling half of `LossScaleOptimizer` (see the module docstring)."""

    def scale_loss(self, loss):
        """Keras 3's hook, called by `fit`: scales like `get_scaled_loss`.

        The gradients of its result go to `apply_gradients` still scaled,
        which unscales them (see `kmp.core.loss_scale.recipes`).

        Args:
            loss: A floating scalar tensor or number.

        Returns:
            `loss` times the current scale, in `loss`'s dtype.

        Raises:
            TypeError: `loss` is not floating point.
            RuntimeError: on JAX, inside `jax.jit` outside a Keras
                `StatelessScope` that maps the optimizer's variables (the
                scale read would be a constant): use
                `stateless_scale_loss`.
        """
        scaled = self._scaled(loss, self._live_scale([loss], "scale_loss"))
        self._recipes.scale_called(recipes.SCALED)
        return scaled

    def get_scaled_loss(self, loss):
        """Returns `loss` times the current scale, in `loss`'s dtype.

        Then `apply_gradients` takes gradients unscaled by
        `get_unscaled_gradients`.

        Args:
            loss: A floating scalar tensor or number, or a callable returning
                one (then a callable is returned).

        Returns:
            The scaled loss (or a callable returning it).

        Raises:
            TypeError: `loss` is not floating point.
            RuntimeError: on JAX, inside `jax.jit` (the scale read would be
                a constant of the compiled step): use
                `stateless_scale_loss` there.
        """
        if callable(loss) and not checks.is_tensor(loss):
            return lambda: self.get_scaled_loss(loss())
        scaled = self._scaled(loss, self._live_scale([loss], "get_scaled_loss"))
        self._recipes.scale_called(recipes.UNSCALED)
        return scaled

    def get_unscaled_gradients(self, grads: Iterable) -> List:
        """Divides each gradient by the current scale, keeping its dtype.

        The division happens in float32 (or float64), never in float16.

        Args:
            grads: Gradients of a scaled loss: tensors, `tf.IndexedSlices`
                (unscaled on their values, kept sparse) or `None` (kept).

        Returns:
            A list of the unscaled gradients, in order.

        Raises:
            TypeError: `grads` is not an iterable of gradients.
            RuntimeError: on JAX, inside `jax.jit` (the scale read would be
                a constant of the compiled step): use
                `stateless_unscale_gradients` there.
        """
        grads = arguments.checked_gradient_list(grads, "grads")
        scale = self._live_scale(grads, "get_unscaled_gradients")
        with keras.name_scope(self.name, caller=self):
            unscaled = self._backend_step.unscale_gradients(grads, scale)
        self._recipes.unscale_called(grads, unscaled)
        return unscaled

    def stateless_scale_loss(self, optimizer_variables, loss):
        """`scale_loss` with the scale taken from `optimizer_variables`.

        For JAX loops over `stateless_apply`: pass the optimizer variables of
        the step, so a jitted function sees the current scale.

        Args:
            optimizer_variables: Values of `optimizer.variables`, as the step
                receives them.
            loss: A floating scalar tensor or number.

        Returns:
            `loss` times the scale held in `optimizer_variables`.

        Raises:
            TypeError: `loss` is not floating point.

        Example:

        >>> import kmp
        >>> opt = kmp.LossScaleOptimizer(
        ...     keras.optimizers.SGD(), initial_scale=4
        ... )
        >>> values = [v.value for v in opt.variables]
        >>> float(opt.stateless_scale_loss(values, 0.5))
        2.0
        """
        scaled = self._scaled(loss, common.scale_of(self, optimizer_variables))
        self._recipes.scale_called(recipes.SCALED)
        return scaled

    def stateless_unscale_gradients(self, optimizer_variables, grads):
        """`get_unscaled_gradients` with the scale from the variables given.

        `stateless_apply` applies its results as they are.

        Args:
            optimizer_variables: Values of `optimizer.variables`, as the step
                receives them.
            grads: Gradients of a scaled loss (tensors or None).

        Returns:
            A list of the unscaled gradients, in order.

        Raises:
            TypeError: `grads` is not an iterable of gradients.
        """
        grads = arguments.checked_gradient_list(grads, "grads")
        scale = common.scale_of(self, optimizer_variables)
        unscaled = self._backend_step.unscale_gradients(grads, scale)
        self._recipes.unscale_called(grads, unscaled)
        return unscaled

    def check_finite(self, grads):
        """Whether no gradient has an inf or a NaN.

        Args:
            grads: Gradients (tensors or None).

        Returns:
            A bool scalar tensor.
        """
        return self._backend_step.all_finite(grads)

    def _live_scale(self, given, method):
        """The scale variable, checked by the backend's step (JAX's: see the
        module docstring)."""
        self._backend_step.check_live_scale(self.dynamic_scale, given, method)
        return self.dynamic_scale

    def _scaled(self, loss, scale):
        loss = arguments.checked_loss(loss)
        return scaling.scale_tensor(loss, scale, divide=False)
