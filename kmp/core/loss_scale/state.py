"""The state a `LossScaleOptimizer` keeps: its variables, their update after
a step, and the persistent-skips report (saving and restoring them, checked,
is `kmp.core.loss_scale.files`).

The variables are Keras's own `LossScaleOptimizer` ones (`iteration`,
`learning_rate`, `step_counter`, `dynamic_scale`, in that order) followed by
kmp's (`skipped_steps`, `consecutive_skips`, `hysteresis_left`; and
`nonfinite_mask` after `build` with `record_nonfinite=True`).
"""

import contextlib
import warnings
from typing import List

import keras
from keras import initializers
from keras import ops

from kmp.core.loss_scale import lagged
from kmp.core.loss_scale import shared_step as common


class PersistentSkipsWarning(RuntimeWarning):
    """Many steps in a row were skipped: training is not progressing."""


class StateMixin:
    """The state half of `LossScaleOptimizer` (see the module docstring)."""

    keras_file_layout = False
    # True while a caller reports persistent skips itself, after the step.
    _skips_reported_by_caller = False

    def _create_state_variables(self):
        hysteresis = 1 if self._rule is None else self._rule.hysteresis
        with name_scope(self):
            self.step_counter = self._state_variable("step_counter", "int", 0)
            self.dynamic_scale = self._state_variable(
                "dynamic_scale", "float32", self._initial_scale
            )
            self.skipped_steps_variable = self._state_variable(
                "skipped_steps", "int", 0
            )
            self.consecutive_skips_variable = self._state_variable(
                "consecutive_skips", "int", 0
            )
            self.hysteresis_left = self._state_variable(
                "hysteresis_left", "int", hysteresis
            )
        self._kmp_state = self._file_state()  # kmp.core.loss_scale.files

    def _state_variable(self, name, dtype, value):
        # Every replica computes the same value; the first one's is kept.
        return self.add_variable(
            shape=(),
            initializer=initializers.Constant(value),
            dtype=dtype,
            aggregation="only_first_replica",
            name=name,
        )

    def _create_nonfinite_mask(self):
        """The mask `nonfinite_variables` reads, once the optimizer knows
        its variables (at `build`), with `record_nonfinite=True`."""
        if self._record_nonfinite and self.nonfinite_mask is None:
            with name_scope(self):
                self.nonfinite_mask = self.add_variable(
                    shape=(len(self._trainable_variables),),
                    initializer="zeros",
                    dtype="bool",
                    aggregation="only_first_replica",
                    name="nonfinite_mask",
                )

    @property
    def nonfinite_variables(self) -> List[str]:
        """Paths of the variables with inf/NaN gradients on the last skip.

        Empty before any skipped step.

        Raises:
            ValueError: the optimizer was created without
                `record_nonfinite=True`.
        """
        if not self._record_nonfinite:
            raise ValueError(
                "nonfinite_variables is recorded only when the optimizer is "
                "created with record_nonfinite=True."
            )
        if self.nonfinite_mask is None:
            return []
        mask = ops.convert_to_numpy(self.nonfinite_mask)
        return [
            v.path for v, bad in zip(self._trainable_variables, mask) if bad
        ]

    def _keras_variables(self):
        """Keras's own four, which its LossScaleOptimizer saves."""
        return [v for v in self._variables[:4]]

    # --- After a step -------------------------------------------------------

    def update_state(self, finite, apply_ok, per_gradient, variables):
        """Assigns the counters, the mask and the rule's new scale.

        Works on variables and, inside a Keras `StatelessScope`, on the values
        it maps them to (`kmp.core.loss_scale.shared_step.update_state`, which
        torch's step calls with its in-place operations).

        Args:
            finite: Whether the step's gradients were all finite.
            apply_ok: Whether the step was applied.
            per_gradient: The finite flag of each gradient, or None.
            variables: The variables of those gradients.

        Returns:
            The new count of skips in a row.
        """
        return common.update_state(
            self,
            finite,
            apply_ok,
            per_gradient,
            variables,
            xp=common.KerasOps,
        )

    # --- Persistent skips ---------------------------------------------------

    def persistent_skips_message(self, in_a_row, scale) -> str:
        """What persistent skips are likely caused by, for the report.

        Args:
            in_a_row: The count of skipped steps in a row.
            scale: The loss scale now.

        Returns:
            The message.
        """
        if self._dynamic:
            cause = (
                "Likely causes: a layer overflows in its forward pass "
                "(float16 activations above 65504) - find it with "
                "kmp.audit(model, x, y) and keep it in float32 with "
                "dtype='float32'; the loss or the final softmax is computed "
                "in float16 - give the last layer dtype='float32'; or the "
                "model produces inf/NaN in float32 too (data, learning rate)."
            )
        else:
            cause = (
                f"The scale is fixed at {float(scale):g}: most likely it is "
                "too large for this model, so every scaled gradient "
                "overflows. Lower initial_scale, or use a dynamic scale "
                "(dynamic=True). Otherwise the model produces inf/NaN by "
                "itself (a float16 layer overflowing: kmp.audit finds it)."
            )
        return (
            f"kmp.LossScaleOptimizer skipped the last {int(in_a_row)} steps "
            "in a row: every one had inf or NaN gradients (or a non-finite "
            f"learning rate), and the loss scale is now {float(scale):g}. "
            + cause
        )

    def report_persistent_skips(self, in_a_row, scale) -> None:
        """Warns once, or raises, if `in_a_row` reached the limit.

        Args:
            in_a_row: The count of skipped steps in a row.
            scale: The loss scale now.

        Raises:
            FloatingPointError: with `on_persistent_skips="raise"`.
        """
        limit = self._max_consecutive_skips
        if limit is None or int(in_a_row) < limit:
            return
        message = self.persistent_skips_message(in_a_row, scale)
        if self._on_persistent_skips == "raise":
            raise FloatingPointError(message)
        if not self._warned_persistent_skips:
            self._warned_persistent_skips = True
            warnings.warn(
                message + " Pass on_persistent_skips='raise' to stop instead.",
                PersistentSkipsWarning,
                stacklevel=2,
            )

    @contextlib.contextmanager
    def _skips_reported_after_step(self):
        """A block whose pure (JAX) steps leave the persistent-skips report
        to the caller, also where they run eagerly: an error raised inside
        the step would lose the state it returns. The caller checks that
        state with `check_persistent_skips` (fit's train function: the
        `compile` patch)."""
        before = self._skips_reported_by_caller
        self._skips_reported_by_caller = True
        try:
            yield
        finally:
            self._skips_reported_by_caller = before

    def report_persistent_skips_now(self) -> None:
        """`report_persistent_skips` on the variables' values (eagerly)."""
        if self._max_consecutive_skips is None:
            return
        self.report_persistent_skips(
            ops.convert_to_numpy(self.consecutive_skips_variable),
            ops.convert_to_numpy(self.dynamic_scale),
        )

    def check_persistent_skips(self, optimizer_variables=None) -> None:
        """Warns or raises if too many steps in a row were skipped.

        For steps compiled by XLA (`jit_compile=True` on TensorFlow, JAX's
        `jit`), which cannot warn or raise from inside: `fit` does it by
        itself (the `compile` patch); in a JAX loop over `stateless_apply`,
        call it with the step's optimizer values after every step (in a
        TensorFlow XLA loop, without arguments).

        It never waits for the step it is given: it keeps that step's two
        numbers (skips in a row and the scale) in a small array of their
        own, starts their copy to the host, and reports on the step before,
        whose numbers have long arrived (`kmp.core.loss_scale.lagged`). So a
        report comes one step late, at the same step on every process;
        `check_persistent_skips_now` after the loop reports on the last
        step. Each call counts as a step: from the newest step it read, it
        knows which steps cannot have reached `max_consecutive_skips` (a
        step adds one skip at most) and neither keeps nor reads those, so
        that most calls cost no work on the device (call it after every
        step: with fewer calls, a run of skips that ends between two of
        them may go unreported). Values that are not device arrays (NumPy,
        torch tensors) are reported at once.

        Args:
            optimizer_variables: Values of `optimizer.variables` (a JAX
                loop's state); None reads the variables.

        Raises:
            FloatingPointError: with `on_persistent_skips="raise"`.
            ValueError: `optimizer_variables` holds more or fewer values
                than `optimizer.variables`.
        """
        self._check_persistent_skips(optimizer_variables)

    def _check_persistent_skips(self, optimizer_variables=None, steps=1):
        """`check_persistent_skips` after a call that ran `steps` steps
        (`fit`'s train function with `steps_per_execution`): the skips in a
        row may have grown by that many since the call before."""
        if self._max_consecutive_skips is None:
            return
        if optimizer_variables is None:
            variables = (self.consecutive_skips_variable, self.dynamic_scale)
            if any(getattr(v, "_value", True) is None for v in variables):
                return  # Held by Keras's JAX trainer: fit checks its state.
            values = tuple(v.value for v in variables)
            if self._backend_step.READS_SKIPS_AT_ONCE:
                self.report_persistent_skips(
                    *(ops.convert_to_numpy(v) for v in values)
                )
                return
        else:
            values = self._skip_values(optimizer_variables)
            if not lagged.is_jax_array(values[0]):
                self.report_persistent_skips(
                    *(ops.convert_to_numpy(v) for v in values)
                )
                return
        checks = self._lagged_checks()
        if checks.needed(self._max_consecutive_skips, steps):
            checks.add(*values, steps=steps)
        else:
            checks.skip(steps)
        for values in checks.due():
            self.report_persistent_skips(*values)

    def _check_persistent_skips_packed(self, packed, steps=1) -> None:
        """`check_persistent_skips` on a call's numbers already packed by
        its step (`kmp.core.loss_scale.lagged.pack`): what `fit` does on JAX
        and under TensorFlow's XLA; the call ran `steps` steps."""
        if self._max_consecutive_skips is None:
            return
        checks = self._lagged_checks()
        checks.add_packed(packed, steps)
        for values in checks.due():
            self.report_persistent_skips(*values)

    def check_persistent_skips_now(self, optimizer_variables=None) -> None:
        """Checks for persistent skips, waiting for the step's values.

        Reports first on the steps `check_persistent_skips` kept (it
        reports a step late), then on `optimizer_variables`. Call it after
        a loop's last step.

        Args:
            optimizer_variables: Values of `optimizer.variables` (a JAX
                loop's state, or the variables themselves); None reads the
                variables.

        Raises:
            FloatingPointError: with `on_persistent_skips="raise"`.
            ValueError: `optimizer_variables` holds more or fewer values
                than `optimizer.variables`.
        """
        if self._max_consecutive_skips is None:
            return
        for values in self._lagged_checks().flush():
            self.report_persistent_skips(*values)
        if optimizer_variables is None:
            in_a_row = self.consecutive_skips_variable
            scale = self.dynamic_scale
        else:
            in_a_row, scale = self._skip_values(optimizer_variables)
        self.report_persistent_skips(
            ops.convert_to_numpy(in_a_row), ops.convert_to_numpy(scale)
        )

    def _discard_pending_skip_checks(self) -> None:
        """Forgets the steps `check_persistent_skips` kept to report later:
        what `fit` and `train_on_batch` do when they end (`kmp.patches.
        compile`), so no report crosses into a later call."""
        self._lagged_checks().clear()

    def _lagged_checks(self):
        checks = self.__dict__.get("_lagged_skip_checks")
        if checks is None:
            checks = lagged.LaggedChecks()
            # Not tracked by Keras (it holds arrays, not variables).
            object.__setattr__(self, "_lagged_skip_checks", checks)
        return checks

    def _skip_values(self, optimizer_variables):
        """Skips in a row and the scale among the values of `variables`."""
        if not isinstance(optimizer_variables, (list, tuple)):
            optimizer_variables = list(optimizer_variables)
        own = self._variables  # First in `variables`, in a fixed order.
        expected = len(own) + len(self._inner_optimizer.variables)
        if len(optimizer_variables) != expected:
            raise ValueError(
                "'optimizer_variables' must hold one value per variable of "
                f"optimizer.variables ({expected}). Received "
                f"{len(optimizer_variables)} values."
            )
        # Their places among `own`, found once (a loop asks every step).
        wanted = (self.consecutive_skips_variable, self.dynamic_scale)
        places = self.__dict__.get("_skip_places")
        if places is None or any(
            own[i] is not w for i, w in zip(places, wanted)
        ):
            places = tuple(
                next(i for i, v in enumerate(own) if v is w) for w in wanted
            )
            object.__setattr__(self, "_skip_places", places)
        return optimizer_variables[places[0]], optimizer_variables[places[1]]


def name_scope(optimizer):
    return keras.name_scope(optimizer.name, caller=optimizer)
