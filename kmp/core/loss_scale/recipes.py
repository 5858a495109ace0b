"""Which loss-scaling recipe the gradients reaching `apply_gradients` follow.

A `LossScaleOptimizer` serves two recipes, and decides between them per
optimizer (and per thread: every `tf.distribute` replica runs in its own)
from what was called on *that* optimizer:

- `scale_loss(loss)` (Keras 3's recipe, which `fit` uses): the gradients
  passed to `apply_gradients` are scaled; it unscales them.
- `get_scaled_loss(loss)` (`tf.keras`'s recipe): they were unscaled by
  `get_unscaled_gradients`; it applies them as they are.
- Neither: unscaled, the custom-loop contract.

`get_unscaled_gradients` may also be called only to look at the gradients:
after `scale_loss`, what reaches `apply_gradients` is still taken as scaled,
unless it is exactly what `get_unscaled_gradients` returned (the same
tensors). Anything else there after both calls is ambiguous and refused.
The decision is made in Python, when a step runs eagerly or is traced, so
it costs nothing per step. A thread that applies gradients without having
called any of these on the optimizer (gradients computed in one thread,
applied in another) follows the thread that called them last.
"""

import threading
import weakref
from typing import List
from typing import Optional

SCALED = "scaled"
UNSCALED = "unscaled"


def _reference(value):
    """A weak reference to `value` where it allows one, else `value`."""
    try:
        return weakref.ref(value)
    except TypeError:  # A JAX tracer, say: kept only while tracing.
        return lambda value=value: value


class _ThreadState:
    def __init__(self):
        self.recipe: Optional[str] = None
        self.forget_unscaled()

    def forget_unscaled(self):
        # id -> weak reference: what get_unscaled_gradients returned (only
        # its identity matters) and what it was given.
        self.outputs = {}
        self.inputs = {}
        # id of an output -> the gradient it was made from, kept until the
        # next apply: a float8 variable's "gradient" is a value, applied as
        # given (see kmp.core.steps.raw_overwrite_gradients).
        self.given_for = {}


class Recipes:
    """The recipe bookkeeping of one optimizer."""

    def __init__(self):
        self._local = threading.local()
        self._last: Optional[_ThreadState] = None  # the latest one written

    def _own(self) -> _ThreadState:
        """This thread's state, for the calls that record something."""
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ThreadState()
        self._last = state
        return state

    def _state(self) -> _ThreadState:
        """The state that decides for this thread: its own, or, if it has
        recorded nothing, the latest thread's."""
        state = getattr(self._local, "state", None)
        if state is not None and (state.recipe is not None or state.outputs):
            return state
        if self._last is not None:
            return self._last
        return self._own()

    @property
    def recipe(self) -> Optional[str]:
        """The recipe of the latest scale call in this thread, or None."""
        return self._state().recipe

    def scale_called(self, recipe: str) -> None:
        """`scale_loss` (SCALED) or `get_scaled_loss` (UNSCALED) was called."""
        state = self._own()
        state.recipe = recipe
        state.forget_unscaled()

    def unscale_called(self, inputs: List, outputs: List) -> None:
        """`get_unscaled_gradients` turned `inputs` into `outputs`."""
        state = self._own()
        state.forget_unscaled()
        for given, made in zip(inputs, outputs):
            if made is None:
                continue
            state.outputs[id(made)] = _reference(made)
            state.inputs[id(given)] = _reference(given)
            state.given_for[id(made)] = given

    def _is_output(self, gradient) -> bool:
        reference = self._state().outputs.get(id(gradient))
        return reference is not None and reference() is gradient

    def _is_input(self, gradient) -> bool:
        reference = self._state().inputs.get(id(gradient))
        return reference is not None and reference() is gradient

    def unscaled_input(self, gradient):
        """What `get_unscaled_gradients` was given for `gradient`, if it
        returned `gradient` (and the step was not applied yet); else None."""
        if not self._is_output(gradient):
            return None
        return self._state().given_for.get(id(gradient))

    def applied(self) -> None:
        """A step was applied: the given gradients need not be kept."""
        self._state().given_for = {}

    def grads_are_scaled(self, grads: List, stateless: bool = False) -> bool:
        """Whether `apply_gradients` must unscale `grads`; see above.

        Args:
            grads: The gradients given to the step.
            stateless: Whether `stateless_apply` was called (the error then
                names its `scaled=False`).

        Raises:
            ValueError: after `scale_loss` and `get_unscaled_gradients`,
                `grads` are neither what `get_unscaled_gradients` was given
                nor what it returned.
        """
        state = self._state()
        present = [g for g in grads if g is not None]
        outputs = [self._is_output(g) for g in present]
        if present and all(outputs):
            return False
        if state.recipe != SCALED:
            return False
        if not state.outputs:
            return True
        if all(self._is_input(g) for g in present) and not any(outputs):
            return True
        if stateless:
            raise ValueError(
                "Cannot tell whether the gradients passed to stateless_apply "
                "are scaled: this optimizer's stateless_scale_loss() (or "
                "scale_loss()) was called, then stateless_unscale_gradients() "
                "(or get_unscaled_gradients()), but stateless_apply got "
                "neither the gradients given to it nor the ones it returned "
                "(transformed ones, such as clipped, or a mix). For "
                "gradients you unscaled, say so: optimizer.stateless_apply("
                "optimizer_variables, grads, trainable_variables, "
                "scaled=False); for gradients of the scaled loss, pass "
                "scaled=True."
            )
        raise ValueError(
            "Cannot tell whether the gradients passed to apply_gradients are "
            "scaled: this optimizer's scale_loss() was called (the Keras 3 "
            "recipe: apply_gradients gets the gradients of the scaled loss "
            "and unscales them), then get_unscaled_gradients(), but "
            "apply_gradients got neither the gradients given to "
            "get_unscaled_gradients nor the ones it returned (transformed "
            "ones, such as clipped, or a mix). For the tf.keras recipe "
            "(unscale, transform, apply), call get_scaled_loss() instead of "
            "scale_loss(); for the Keras 3 recipe, pass the gradients of the "
            "scaled loss to apply_gradients unchanged."
        )
