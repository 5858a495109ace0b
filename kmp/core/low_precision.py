"""`LowPrecisionOptimizer`: bfloat16 weights and optimizer slots that learn.

Under a pure `"bfloat16"` policy Keras's optimizers update bfloat16 variables
in bfloat16: an update smaller than half a unit in the last place of a weight
(bfloat16 keeps 8 significant bits) is rounded away, and training stalls. Mixed
precision avoids that with float32 weights and slots: 12 bytes per parameter
for Adam before any activation.

`LowPrecisionOptimizer(inner)` runs any Keras optimizer's own update in
float32 on variables of any floating dtype, then writes the result back in the
variable's dtype, rounded by one of:

* `"kahan"` (default): a compensation buffer per low-precision variable, of
  its dtype, carries what rounding dropped into the next step:
  `t = (w + c) + update` in float32, `w = round(t)`, `c = round(t - w)`;
* `"stochastic"`: rounds up with probability equal to the distance from the
  lower neighbour (unbiased on average), from a stateless random stream keyed
  by (seed, step, variable index): reproducible, identical on every replica,
  resumable;
* `"nearest"`: rounds to nearest once, after the float32 update.

`slot_dtype="bfloat16"` keeps the inner optimizer's slots (Adam's moments,
momentum) in bfloat16 while its arithmetic stays float32, for float32
(mixed-precision) variables too. Float32 variables are written back exactly:
with them and the default `slot_dtype`, results are the inner optimizer's,
bit for bit.

The mechanism: the inner optimizer's own `_backend_update_step` runs (its
per-step work and `tf.distribute` updates included), but each variable's
`update_step` gets a float32 stand-in for it: it reads as `w + c` in float32,
records what is assigned, and carries the variable's slot lookup key; the
stand-in's value is then rounded into the variable. Nothing float32 the size
of a weight outlives the step, and for variables of 2**16 elements or more the
update is compiled with XLA, so no float32 temporaries are made at all.

Limits: the compensation buffer has 8 significant bits too, so Kahan follows
float32 within a fraction of an ulp for varying updates but drifts by a few
ulps over ten thousand identical ones; stochastic rounding is unbiased, but
each weight's error is a random walk (about sqrt(steps * update / ulp) ulps).

Example:

>>> import kmp
>>> with kmp.policy_scope("bfloat16"):
...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
>>> optimizer = kmp.LowPrecisionOptimizer(keras.optimizers.Adam(0.1), seed=1)
>>> model.compile(optimizer=optimizer, loss="mse")
>>> x, y = keras.ops.ones((8, 4)), keras.ops.ones((8, 2))
>>> losses = model.fit(x, y, epochs=5, verbose=0).history["loss"]
>>> model.layers[0].kernel.dtype, losses[-1] < losses[0]
('bfloat16', True)
>>> [(tuple(v.shape), v.dtype) for v in optimizer.variables if "comp" in v.name]
[((4, 2), 'bfloat16'), ((2,), 'bfloat16')]
>>> sorted({v.dtype for v in optimizer.inner_optimizer.variables})
['bfloat16', 'float32', 'int64']
"""

import contextlib
import functools
import numbers
import random
import threading

import keras
import tensorflow as tf

from kmp.core import checks
from kmp.core import optimizer_arguments
from kmp.core import rounding

ROUNDINGS = ("kahan", "stochastic", "nearest")
SLOT_DTYPES = ("bfloat16", "float16", "float32")
_MAX_SEED = 2**63 - 1


def _refuse(error, argument, allowed, value):
    received = checks.describe(value) if error is TypeError else repr(value)
    raise error(
        f"'{argument}' must be {allowed}. Received: {argument}={received}"
    )


def _check_arguments(inner, rounding, slot_dtype, seed):
    """Validates the constructor's arguments; changes nothing."""
    if isinstance(
        inner, (keras.optimizers.LossScaleOptimizer, LowPrecisionOptimizer)
    ):
        allowed = (
            "a plain Keras optimizer; for loss scaling wrap the other way "
            "round: kmp.LossScaleOptimizer(kmp.LowPrecisionOptimizer(...))"
        )
        _refuse(TypeError, "inner_optimizer", allowed, inner)
    if not isinstance(inner, keras.optimizers.Optimizer):
        allowed = "a Keras optimizer instance, such as keras.optimizers.Adam()"
        _refuse(TypeError, "inner_optimizer", allowed, inner)
    for attribute, why in (
        ("use_ema", "the average would round like the weights"),
        ("gradient_accumulation_steps", "the sums would round too"),
        ("loss_scale_factor", "wrap in kmp.LossScaleOptimizer instead"),
    ):
        if getattr(inner, attribute, None):
            allowed = f"unset in 'inner_optimizer' ({why})"
            _refuse(ValueError, attribute, allowed, getattr(inner, attribute))
    if inner.built:
        raise ValueError(
            "'inner_optimizer' must not be built yet: LowPrecisionOptimizer "
            f"builds it, with its slots in slot_dtype. Received: {inner.name!r}"
            f", built on {len(inner._trainable_variables)} variables"
        )
    for argument, value, choices in (
        ("rounding", rounding, ROUNDINGS),
        ("slot_dtype", slot_dtype, (None, *SLOT_DTYPES)),
    ):
        allowed = "one of " + ", ".join(map(repr, choices))
        if value is not None and not isinstance(value, str):
            _refuse(TypeError, argument, allowed, value)
        if value not in choices:
            _refuse(ValueError, argument, allowed, value)
    allowed = "None or an integer in [0, 2**63 - 1]"
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
    ):
        _refuse(TypeError, "seed", allowed, seed)
    if seed is not None and not 0 <= seed <= _MAX_SEED:
        _refuse(ValueError, "seed", allowed, seed)


@keras.saving.register_keras_serializable(package="kmp")
class LowPrecisionOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer: float32 updates of low-precision variables.

    See the module docstring for what each `rounding` does. Works in `fit`
    and custom loops, eagerly, in `tf.function`, under XLA and
    `MirroredStrategy` (every replica rounds identically), and inside
    `kmp.LossScaleOptimizer` for float16 variables. Its compensation buffers
    and seed are in `variables` and in checkpoints; the stochastic stream
    follows the inner optimizer's `iterations`, so a resumed run is
    bit-identical to an uninterrupted one.

    Args:
        inner_optimizer: The Keras optimizer whose update is applied (any
            built-in one, or `kmp.FusedAdam`, which then runs Keras's Adam
            update); not built yet, without `use_ema`,
            `gradient_accumulation_steps` or `loss_scale_factor`.
        rounding: `"kahan"` (default), `"stochastic"` or `"nearest"`: how a
            float32 result is written to a bfloat16 or float16 variable.
        slot_dtype: The dtype of every floating variable the inner optimizer
            creates for itself (moments, momentum, accumulators):
            `"bfloat16"`, `"float16"`, `"float32"`, or None (default) for
            each variable's own dtype, as Keras does. Not float16 for
            Adam-like optimizers: a squared gradient underflows there
            (use `"bfloat16"` with float16 variables).
        seed: The stochastic-rounding seed, an integer; None draws one from
            Python's `random` (seeded by `keras.utils.set_random_seed`).
        name: The optimizer's name.

    Raises:
        TypeError: `inner_optimizer` is not a Keras optimizer or is a
            loss-scale or low-precision one; an argument has the wrong type.
        ValueError: an argument has a wrong value, or the inner optimizer
            is built or uses EMA, gradient accumulation or a loss scale.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        rounding: str = "kahan",
        slot_dtype=None,
        seed=None,
        name=None,
    ):
        _check_arguments(inner_optimizer, rounding, slot_dtype, seed)
        super().__init__(learning_rate=0.0, name=name)
        self._inner_optimizer = inner_optimizer
        self._rounding = rounding
        self._slot_dtype = slot_dtype
        self._seed_argument = seed
        with keras.name_scope(self.name, caller=self):
            self._seed = keras.Variable(
                random.getrandbits(62) if seed is None else seed,
                dtype="int64",
                trainable=False,
                aggregation="only_first_replica",
                name="seed",
            )
        self._compensations = []
        # Run-time cache, not state: past Keras's tracking.
        object.__setattr__(self, "_compiled", {})

    @property
    def inner_optimizer(self) -> keras.optimizers.Optimizer:
        """The wrapped optimizer, which computes every update."""
        return self._inner_optimizer

    @property
    def rounding(self) -> str:
        return self._rounding

    @property
    def slot_dtype(self):
        return self._slot_dtype

    @property
    def seed(self) -> tf.Tensor:
        """The stochastic-rounding seed in use (an int64 scalar tensor)."""
        return tf.convert_to_tensor(self._seed)

    @property
    def iterations(self):
        return self._inner_optimizer.iterations

    @property
    def variables(self):
        return self._variables + self._inner_optimizer.variables

    @property
    def learning_rate(self):
        return self._inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        value = optimizer_arguments.checked_learning_rate(value)
        self._inner_optimizer.learning_rate = value

    def __setattr__(self, name, value):
        # Keras's optimizer tracks a variable assigned to an attribute
        # before a property setter runs: check the learning rate first.
        if name == "learning_rate" and "_inner_optimizer" in self.__dict__:
            value = optimizer_arguments.checked_learning_rate(value)
        super().__setattr__(name, value)

    def finalize_variable_values(self, var_list):
        self._inner_optimizer.finalize_variable_values(var_list)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._build_inner(var_list)
        kahan = self._rounding == "kahan"
        self._compensations = [
            self.add_variable_from_reference(variable, "compensation")
            if kahan
            and _standard(variable.dtype) in rounding.LOW_PRECISION_BITS
            else None
            for variable in var_list
        ]

    def _build_inner(self, var_list):
        inner = self._inner_optimizer
        slot_dtype = self._slot_dtype
        if slot_dtype is None:
            inner.build(var_list)
            return
        original = inner.add_variable

        def add_variable(shape, initializer="zeros", dtype=None, **kwargs):
            if dtype is None or tf.as_dtype(_standard(dtype)).is_floating:
                dtype = slot_dtype
            return original(shape, initializer, dtype, **kwargs)

        inner.add_variable = add_variable
        try:
            inner.build(var_list)
        finally:
            del inner.add_variable

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "apply() without 'trainable_variables' needs a built "
                    "optimizer: call optimizer.build(variables) first, or "
                    "pass the variables."
                )
            trainable_variables = self._trainable_variables
        variables = list(trainable_variables)
        grads = checks.checked_gradients(grads, variables)
        if not grads:
            return
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        self._check_variables_are_known(variables)
        inner = self._inner_optimizer
        with keras.name_scope(self.name, caller=self):
            grads, variables = inner._filter_empty_gradients(grads, variables)
            grads, variables = (
                inner._overwrite_variables_directly_with_gradients(
                    grads, variables
                )
            )
            if grads:
                grads = inner._clip_gradients(grads)
                # Summed here, where kmp.LossScaleOptimizer can turn it off.
                pairs = self._all_reduce_sum_gradients(
                    list(zip(grads, variables))
                )
                with _routed_through(self):
                    inner._backend_update_step(
                        [g for g, _ in pairs],
                        [v for _, v in pairs],
                        inner.learning_rate,
                    )
            inner._iterations.assign_add(1)

    def _update_step(self, gradient, variable, learning_rate):
        """The inner optimizer's `update_step`, in float32, then rounded.

        Called for each variable by the inner optimizer's own
        `_backend_update_step` (Nadam's per-step work and `tf.distribute`'s
        per-device updates included), in place of its `update_step`.
        """
        index = self._get_variable_index(variable)
        size = variable.shape.num_elements() or 0
        low = (
            _standard(variable.dtype) in rounding.LOW_PRECISION_BITS
            or self._slot_dtype in rounding.LOW_PRECISION_BITS
        )
        if not low or size < _COMPILE_MIN_ELEMENTS:
            return self._update_one(gradient, learning_rate, variable, index)
        # Compiled with XLA, the float32 arithmetic on low-precision state is
        # fused: no float32 temporaries the size of the variable (on the
        # 20M-parameter MLP, 220 MB of them at the step's peak).
        key = (index, id(variable))
        if key not in self._compiled:
            self._compiled[key] = tf.function(
                functools.partial(
                    self._update_one, variable=variable, index=index
                ),
                jit_compile=True,
                autograph=False,
            )
        self._compiled[key](
            gradient, tf.cast(tf.convert_to_tensor(learning_rate), tf.float32)
        )

    def _update_one(self, gradient, learning_rate, variable, index):
        inner = self._inner_optimizer
        model_variable = self._trainable_variables[index]
        low = _standard(variable.dtype) in rounding.LOW_PRECISION_BITS
        compensation = self._compensations[index]
        view = rounding.Float32View(
            variable,
            model_variable,
            None if compensation is None else compensation.value,
            inner._var_key(variable),
            "float32" if low else _standard(variable.dtype),
        )
        self._decay(view, model_variable, learning_rate)
        type(inner).update_step(inner, gradient, view, learning_rate)
        if not view.written:
            return
        value = view.value
        constraint = getattr(model_variable, "constraint", None)
        if constraint is not None:
            value = constraint(value)
        if not low:
            self.assign(variable, value)
        elif self._rounding == "stochastic":
            seed = tf.stack(
                [
                    tf.convert_to_tensor(self._seed),
                    tf.cast(tf.convert_to_tensor(inner._iterations), tf.int64),
                ]
            )
            seed = tf.random.experimental.stateless_fold_in(
                seed, index, alg="philox"
            )
            self.assign(
                variable, rounding.stochastic_round(value, variable.dtype, seed)
            )
        else:
            rounded = tf.cast(value, variable.dtype)
            self.assign(variable, rounded)
            if compensation is not None:
                remainder = value - tf.cast(rounded, tf.float32)
                self.assign(compensation, remainder)

    def _decay(self, view, model_variable, learning_rate):
        """The inner optimizer's weight decay, on the float32 view."""
        inner = self._inner_optimizer
        if type(inner)._apply_weight_decay is not _KERAS_WEIGHT_DECAY:
            # Written for plain variables (Muon): it runs on the view as is.
            inner._apply_weight_decay([view])
        elif inner.weight_decay is not None and inner._use_weight_decay(
            model_variable
        ):
            decay = tf.cast(inner.weight_decay, view.dtype)
            rate = tf.cast(learning_rate, view.dtype)
            view.assign_sub(view.value * decay * rate)

    def get_config(self) -> dict:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self._inner_optimizer
            ),
            "rounding": self._rounding,
            "slot_dtype": self._slot_dtype,
            "seed": self._seed_argument,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        if not isinstance(config, dict) or "inner_optimizer" not in config:
            raise ValueError(
                "'config' must be a dict with at least the key "
                "'inner_optimizer', as returned by get_config(). Received: "
                f"config={checks.describe(config)}"
            )
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


_KERAS_WEIGHT_DECAY = keras.optimizers.Optimizer._apply_weight_decay
# Smaller variables' temporaries are small; compiling each would cost more.
_COMPILE_MIN_ELEMENTS = 2**16
_routing_lock = threading.Lock()
_routing_depth = {}


@contextlib.contextmanager
def _routed_through(wrapper):
    """Makes the inner optimizer's `update_step` the wrapper's, for a while.

    The inner optimizer applies the gradients the wrapper already summed
    over replicas, as they are. Replica threads enter this together, hence
    the count.
    """
    inner = wrapper._inner_optimizer
    key = id(inner)
    with _routing_lock:
        depth = _routing_depth.get(key, 0)
        if depth == 0:
            inner.update_step = wrapper._update_step
            inner._all_reduce_sum_gradients = list
        _routing_depth[key] = depth + 1
    try:
        yield
    finally:
        with _routing_lock:
            _routing_depth[key] -= 1
            if _routing_depth[key] == 0:
                del _routing_depth[key]
                del inner.update_step
                del inner._all_reduce_sum_gradients


def _is_low(dtype) -> bool:
    return dtype is not None and _standard(dtype) in rounding.LOW_PRECISION_BITS


def _standard(dtype) -> str:
    return tf.as_dtype(dtype).name
