"""`LossScaleOptimizer`: loss scaling for `model.fit` and for custom loops.

Every step it decides whether the gradients it gets are scaled
(`kmp.core.loss_scale.recipes`), sums them across replicas once
(`tf.distribute`), divides them by the scale if they are scaled, checks them
for inf/NaN (after the sum, so every replica decides alike), applies them with
the inner optimizer only if all are finite, and assigns the state the scale
rule returns (`kmp.core.loss_scale.rule`). The class holds the variables and
reads like Keras's own; its halves are in `kmp.core.loss_scale`: the checks of
its arguments (`arguments`), its state (`state`) and its files (`files`), the
scaling calls (`scale_calls`) and the state a skipped step puts back
(`keep_on_skip`). Each backend's whole step (`kmp.core.tensorflow.step`,
`kmp.core.jax.step`, `kmp.core.torch.step`: the same names on each) is picked
once, here, over what they share (`kmp.core.loss_scale.shared_step`).
"""

from typing import Optional

import keras
from keras.src.saving import serialization_lib

from kmp.core import backend
from kmp.core import checks
from kmp.core.loss_scale import arguments
from kmp.core.loss_scale import keep_on_skip as kept_state
from kmp.core.loss_scale import recipes
from kmp.core.loss_scale import rule as rule_module
from kmp.core.loss_scale import shared_step as steps
from kmp.core.loss_scale.arguments import ArgumentTypeError
from kmp.core.loss_scale.files import FilesMixin
from kmp.core.loss_scale.scale_calls import ScalingMixin
from kmp.core.loss_scale.state import PersistentSkipsWarning
from kmp.core.loss_scale.state import StateMixin
from kmp.core.loss_scale.state import name_scope

# This backend's step (`apply`, `stateless_apply`, `snapshot` and the
# strategy checks): the one place `LossScaleOptimizer` picks a backend.
if backend.is_tensorflow():
    from kmp.core.tensorflow import step as _step
elif backend.is_jax():
    from kmp.core.jax import step as _step
else:
    from kmp.core.torch import step as _step

# A snapshot of a variable's value now (a tensor later steps do not change).
read_value = _step.read_value

_KerasLossScaleOptimizer = keras.optimizers.LossScaleOptimizer
_KerasOptimizer = keras.optimizers.Optimizer


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleOptimizer(
    StateMixin,
    FilesMixin,
    ScalingMixin,
    kept_state.KeepOnSkipMixin,
    _KerasLossScaleOptimizer,
):
    """Wraps a Keras optimizer and scales the loss so float16 gradients survive.

    Under `mixed_float16`, small gradients underflow to zero in float16.
    Multiplying the loss by a scale multiplies every gradient by it too;
    dividing the gradients by it before they are applied gives back the true
    update.

    * Dynamic (default): start at `initial_scale` (2**15); after
      `dynamic_growth_steps` (2000) finite steps in a row, multiply by
      `growth_factor` (2); on a step with any inf/NaN gradient, skip it and
      multiply by `backoff_factor` (0.5), never below `min_scale` (1).
    * Fixed (`dynamic=False`): the scale is `initial_scale` forever; a step with
      an inf/NaN gradient is still skipped.

    In `model.fit` all of it happens by itself. In a custom loop, either
    recipe (decided per optimizer, see `kmp.core.loss_scale.recipes`):

        # tf.keras's: unscale, (transform,) apply.
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

        # Keras 3's: apply_gradients unscales.
        ...  scaled_loss = optimizer.scale_loss(loss)
        optimizer.apply_gradients(zip(scaled_grads, vars))

    On JAX, `stateless_scale_loss` / `stateless_unscale_gradients` take the
    optimizer's variables explicitly, for loops over `stateless_apply`
    (inside `jax.jit` the stateful calls raise).

    A skipped step leaves the variables it was to update, the inner
    optimizer's slots and `iterations` exactly as they were, bit for bit;
    in `fit` also the model's non-trainable variables (BatchNormalization's
    moving statistics), which the forward pass of the same step wrote; in
    a custom loop those passed to `keep_on_skip` (`stateless_keep_on_skip`
    in a JAX loop). Not restored: the loss-scale state (it records the
    skip), Keras metrics (they log the inf/NaN loss, as Keras's own do).

    A step not finite on one replica or process is skipped on all (under
    `torch.distributed`, where the gradients are all-reduced, or the check
    agreed: `kmp.core.torch_distributed`). Processes whose optimizers were built
    differently raise a `ValueError` (`kmp.core.loss_scale.process_settings`).

    Args:
        inner_optimizer: The Keras optimizer to wrap (not a loss-scale one),
            with a finite learning rate (or a schedule, or a callable).
        dynamic: Whether the scale adapts (True) or stays fixed (False).
        initial_scale: The first scale: when dynamic, a finite number from
            `min_scale` (1 by default, as low as 2**-24) to `max_scale`,
            2**15 by default; when fixed, required, from 1 to the largest
            float32.
        dynamic_growth_steps: Finite steps in a row before the scale grows;
            a positive integer, 2000 by default; must be None when fixed.
        name: The optimizer's name.
        growth_factor: What the scale is multiplied by when it grows, > 1.
        backoff_factor: What it is multiplied by on a skipped step, in (0, 1).
        min_scale: The floor (1); may be as low as 2**-24.
        max_scale: The ceiling (the largest float32); the scale grows only
            while it stays at or below it.
        hysteresis: The scale backs off on the hysteresis-th skipped step
            since it last grew, and on every one after (DeepSpeed's
            `hysteresis`); 1 (default) backs off on each.
        max_consecutive_skips: After this many skipped steps in a row (1000 by
            default; None turns the check off) something is persistently
            wrong: the optimizer warns once, naming the likely causes.
        on_persistent_skips: `"warn"` (default) or `"raise"`, which stops
            training with a `FloatingPointError` on every step from then on
            (inside a `tf.function` TensorFlow raises it as a
            `tf.errors.UnknownError` carrying that message). Under XLA no
            Python runs in the step: `kmp.callbacks.LossScaleMonitor` (or
            `check_persistent_skips()` in a loop) does the check instead.
        record_nonfinite: Whether to record which variables had non-finite
            gradients on the last skipped step (`nonfinite_variables`).

    A number may be any real number (a Python or NumPy int or float, a
    `Fraction`, a `Decimal`). The scale and the rule's settings are rounded
    to float32, the dtype they are applied in, once, and checked after
    rounding; the properties, `get_config` and the checks of restored state
    use the rounded values (`min_scale=0.7` is 0.699999988079071), and a
    value float32 changes in meaning (a factor that rounds to 1, a non-zero
    that rounds to 0, one beyond float32's range) is refused.

    Raises:
        TypeError: `inner_optimizer` is not a Keras optimizer, or is already a
            loss-scale optimizer; an argument has the wrong type (for
            `initial_scale` and `dynamic_growth_steps` an `ArgumentTypeError`,
            which is a `ValueError` too).
        ValueError: an argument has a wrong value (the inner optimizer's
            learning rate is not finite in float32, say), or the optimizer
            is created under an unsupported distribution strategy (TPU,
            parameter servers).

    Example:

    >>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8)
    >>> float(opt.loss_scale), int(opt.dynamic_counter)
    (8.0, 0)
    >>> float(opt.get_scaled_loss(0.5))
    4.0
    >>> [float(g) for g in opt.get_unscaled_gradients([4.0])]
    [0.5]
    """

    # This backend's step module, for the halves of the class
    # (`kmp.core.loss_scale`): its division and check, its checkpoint, how
    # it reads the persistent-skips numbers.
    _backend_step = _step

    def __init__(
        self,
        inner_optimizer: _KerasOptimizer,
        dynamic: bool = True,
        initial_scale: Optional[float] = None,
        dynamic_growth_steps: Optional[int] = None,
        name: Optional[str] = None,
        *,
        growth_factor: Optional[float] = None,
        backoff_factor: Optional[float] = None,
        min_scale: Optional[float] = None,
        max_scale: Optional[float] = None,
        hysteresis: Optional[int] = None,
        max_consecutive_skips: Optional[int] = 1000,
        on_persistent_skips: str = "warn",
        record_nonfinite: bool = False,
        **kwargs,
    ):
        backend.check_supported("kmp.LossScaleOptimizer")
        arguments.check_keras_kwargs(kwargs)
        arguments.check_inner(inner_optimizer)
        arguments.check_dynamic(dynamic)
        knobs = {
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "min_scale": min_scale,
            "max_scale": max_scale,
            "hysteresis": hysteresis,
        }
        rule, initial_scale = arguments.check_scale_settings(
            dynamic, initial_scale, dynamic_growth_steps, knobs
        )
        (
            max_consecutive_skips,
            on_persistent_skips,
            record_nonfinite,
        ) = arguments.checked_skip_options(
            max_consecutive_skips, on_persistent_skips, record_nonfinite
        )
        _step.check_strategy()
        # Keras's LossScaleOptimizer is the base class so that Keras treats
        # this one as a loss-scale optimizer (compile does not wrap it
        # again); its constructor mutates the inner optimizer, so it is
        # skipped, and what it sets is set here.
        _KerasOptimizer.__init__(self, learning_rate=0.0, name=name)
        self._inner_optimizer = inner_optimizer
        self._dynamic = dynamic
        self._rule = rule
        # The values the rule applies (float32-rounded), for get_config.
        self._knobs = {
            key: getattr(rule, key)
            for key, value in knobs.items()
            if value is not None
        }
        self._initial_scale = initial_scale
        self._max_consecutive_skips = max_consecutive_skips
        self._on_persistent_skips = on_persistent_skips
        self._record_nonfinite = record_nonfinite
        self._warned_persistent_skips = False
        self._recipes = recipes.Recipes()
        self._kept_states = steps.KeptStates(_step.snapshot)
        self.nonfinite_mask = None
        _step.check_processes(self)
        self._create_state_variables()

    @property
    def inner_optimizer(self) -> _KerasOptimizer:
        """The wrapped optimizer, which computes every update."""
        return self._inner_optimizer

    @property
    def dynamic(self) -> bool:
        """Whether the loss scale adapts (True) or is fixed (False)."""
        return self._dynamic

    @property
    def initial_scale(self) -> float:
        """The loss scale training started with, a Python float.

        It is the float32 value the scale variable holds:
        `initial_scale=1000.1` gives 1000.0999755859375.
        """
        return self._initial_scale

    @property
    def dynamic_growth_steps(self) -> Optional[int]:
        """Finite steps in a row before the scale grows; None when fixed."""
        return self._rule.growth_steps if self._dynamic else None

    @property
    def rule(self) -> Optional[rule_module.ScaleRule]:
        """The dynamic rule's settings (`ScaleRule`); None when fixed."""
        return self._rule

    @property
    def max_consecutive_skips(self) -> Optional[int]:
        """Skipped steps in a row counted as persistent, or None (no check)."""
        return self._max_consecutive_skips

    @property
    def on_persistent_skips(self) -> str:
        """`"warn"` or `"raise"`: what persistent skips do."""
        return self._on_persistent_skips

    @property
    def loss_scale(self):
        """The current loss scale, a float32 scalar tensor."""
        return read_value(self.dynamic_scale)

    @property
    def dynamic_counter(self):
        """The rule's counter of finite steps in a row; None if fixed.

        It counts finite steps since the last growth or non-finite step,
        and resets to 0 when it reaches `dynamic_growth_steps` (whether the
        scale grew or growth was refused at `max_scale`) and on every
        non-finite step (also one that hysteresis absorbs, leaving the
        scale as it was).
        """
        if not self._dynamic:
            return None
        return read_value(self.step_counter)

    @property
    def skipped_steps(self):
        """How many steps were skipped for non-finite gradients."""
        return read_value(self.skipped_steps_variable)

    @property
    def consecutive_skips(self):
        """How many of the latest steps were skipped in a row."""
        return read_value(self.consecutive_skips_variable)

    @property
    def variables(self):
        return self._variables + self._inner_optimizer.variables

    @property
    def iterations(self):
        return self._inner_optimizer.iterations

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate (read and assign)."""
        return self._inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        value = arguments.checked_learning_rate(value)
        self._inner_optimizer.learning_rate = value

    @property
    def lr(self):
        """Keras 2's alias of `learning_rate`, read and assigned alike.

        For code ported from `tf.keras`; Keras 3's optimizers have no `lr`.
        """
        return self.learning_rate

    @lr.setter
    def lr(self, value):
        value = arguments.checked_learning_rate(value, "lr")
        self._inner_optimizer.learning_rate = value

    def __setattr__(self, name, value):
        # Keras's optimizer tracks a variable assigned to any attribute
        # before a property setter runs: the inner optimizer tracks its
        # learning rate, and the setter checks it before anything changes.
        if name in ("learning_rate", "lr") and "_inner_optimizer" in (
            self.__dict__
        ):
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    def build(self, var_list):
        _step.check_processes(self)
        self._inner_optimizer.build(var_list)
        _KerasOptimizer.build(self, var_list)
        self._create_nonfinite_mask()

    def apply_gradients(
        self,
        grads_and_vars,
        name: Optional[str] = None,
        experimental_aggregate_gradients: bool = True,
        *,
        skip_gradients_aggregation: bool = False,
    ):
        """Applies `(gradient, variable)` pairs; returns `iterations`.

        Under a `tf.distribute` strategy the gradients are summed across
        replicas once, here, unless the caller summed them already.

        Args:
            grads_and_vars: `(gradient, variable)` pairs, such as
                `zip(grads, model.trainable_variables)`.
            name: Keras 2's name of the returned op; accepted for ported
                code and not used (Keras 3 names no ops).
            experimental_aggregate_gradients: Keras 2's switch: False means
                the gradients are already summed across replicas (as by
                `replica_context.all_reduce`); they are not summed again,
                and every replica still skips a step together. (On JAX and
                torch gradients are never summed here: nothing changes.)
            skip_gradients_aggregation: Keras 2.11's name for the same:
                True means already summed.

        Returns:
            The optimizer's `iterations` variable.

        Raises:
            TypeError, ValueError: see `apply`; also for pairs that are not
                pairs, for no pairs at all (an exhausted `zip`), and for
                Keras 2's arguments of the wrong type.
        """
        grads, variables, aggregate = arguments.checked_pairs(
            grads_and_vars,
            name,
            experimental_aggregate_gradients,
            skip_gradients_aggregation,
        )
        self._apply(grads, variables, aggregate=aggregate)
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Applies one step; see the class docstring.

        Args:
            grads: One gradient (or None) per variable.
            trainable_variables: The variables; by default those the
                optimizer was built with.

        Raises:
            TypeError: a variable is not a variable, or a gradient is not a
                floating tensor, `tf.IndexedSlices` or None.
            ValueError: the counts of gradients and variables differ, a
                gradient's shape is not its variable's, or the recipe is
                ambiguous (see `kmp.core.loss_scale.recipes`).
        """
        self._apply(grads, trainable_variables, aggregate=True)

    def _apply(self, grads, trainable_variables, aggregate):
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "apply() without 'trainable_variables' needs a built "
                    "optimizer: call "
                    "optimizer.build(model.trainable_variables) first, or "
                    "pass the variables."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        grads = checks.checked_gradients(grads, trainable_variables)
        if not grads:
            return  # As Keras: no gradients, no step.
        _step.check_replica_context()
        if not self.built:
            with name_scope(self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        scaled = self._recipes.grads_are_scaled(grads)
        grads = steps.raw_overwrite_gradients(self, grads, trainable_variables)
        self._recipes.applied()
        with name_scope(self):
            _step.apply(self, grads, trainable_variables, scaled, aggregate)

    def stateless_apply(
        self, optimizer_variables, grads, trainable_variables, *, scaled=None
    ):
        """Keras's `stateless_apply`, with kmp's skip and scale rule.

        Args:
            optimizer_variables: Values of `optimizer.variables`.
            grads: One gradient (or None) per variable the optimizer was
                built with.
            trainable_variables: Values of those variables.
            scaled: Whether `grads` are scaled; None decides from what was
                called on this optimizer (see `kmp.core.loss_scale.recipes`).

        Returns:
            `(new trainable variable values, new optimizer variable values)`.
        """
        return _step.stateless_apply(
            self, optimizer_variables, grads, trainable_variables, scaled
        )

    def finalize_variable_values(self, var_list):
        self._inner_optimizer.finalize_variable_values(var_list)

    def get_config(self) -> dict:
        """Keras's four keys, and kmp's settings where not at the default.

        Returns:
            A dict that `from_config` takes back.
        """
        config = {
            "name": self.name,
            "inner_optimizer": serialization_lib.serialize_keras_object(
                self._inner_optimizer
            ),
            "initial_scale": self._initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
        }
        settings = {
            "dynamic": self._dynamic,
            "max_consecutive_skips": self._max_consecutive_skips,
            "on_persistent_skips": self._on_persistent_skips,
            "record_nonfinite": self._record_nonfinite,
        }
        defaults = arguments.DEFAULT_SETTINGS
        config.update({k: v for k, v in settings.items() if v != defaults[k]})
        config.update(self._knobs)
        return config

    @classmethod
    def from_config(cls, config: dict, custom_objects=None):
        """Creates the optimizer from `get_config()`'s output.

        Args:
            config: A dict with at least the key `"inner_optimizer"`.
            custom_objects: Passed on to Keras's deserialization of the
                inner optimizer.

        Returns:
            A `LossScaleOptimizer`.

        Raises:
            ValueError: `config` is not such a dict.
        """
        config = arguments.checked_config(config)
        inner = serialization_lib.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


__all__ = ["ArgumentTypeError", "LossScaleOptimizer", "PersistentSkipsWarning"]
