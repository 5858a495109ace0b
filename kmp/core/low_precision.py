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
  by (seed, step, variable index): reproducible, identical on every replica
  and device, resumable (the stream is the backend's: TensorFlow's Philox;
  on JAX and torch the same counter-based hash, so the same seed rounds
  alike on both);
* `"nearest"`: rounds to nearest once, after the float32 update.

By default the inner optimizer's slots (Adam's moments, momentum) are in
each variable's dtype, except float16 variables', which are float32: Adam's
second moment, a squared gradient, underflows float16.
`slot_dtype="bfloat16"` keeps every slot in bfloat16 while its arithmetic
stays float32, for float32 (mixed-precision) variables too;
`slot_dtype="8bit"` keeps the moments of Adam, AdamW, Lion and SGD in one
byte per element with a scale per block, `"4bit"` in half a byte,
`"float8"` as float8_e4m3fn bytes (`kmp.core.low_bit.slots`). Float32
variables are written back exactly: with them and the default `slot_dtype`,
results are the inner optimizer's, bit for bit.

The mechanism, the same on every backend: the inner optimizer's own
`_backend_update_step` runs (its per-step work included), but each
variable's `update_step` gets a float32 stand-in for it
(`kmp.core.low_bit.rounding.Float32View`; TensorFlow's is in
`kmp.core.tensorflow.rounding`): it reads as `w + c` in float32, records
what is assigned, and leads the inner optimizer to the variable's slots;
the stand-in's value is then rounded into the variable. Nothing float32
the size of a weight outlives the step. What each backend adds is in its
package: on TensorFlow (`kmp.core.tensorflow.low_precision`)
`tf.distribute`'s per-replica updates, and XLA for variables of 2**16
elements or more, so no float32 temporaries are made at all; on torch
(`kmp.core.torch.low_precision`) Keras's fused (`torch._foreach`) update
where no variable needs rounding, and Adam's and AdamW's update of each
variable compiled with `torch.compile` (`kmp.core.torch.compiled`; the
environment variable `KMP_TORCH_COMPILE=0` keeps it eager); on JAX
(`kmp.core.jax.low_precision`) nothing more. On all three, large variables
with quantized slots, or with 16-bit weights or slots under Adam,
AdamW, Lion or SGD, are updated in parts, which bounds the temporaries
(`kmp.core.low_bit.parts`).
On JAX the whole update is pure, so `stateless_apply` (which `fit` and a
jitted loop call) works as for any Keras optimizer.
With `shard_state=True` (JAX, under a `keras.distribution`) the state is
split over the data-parallel devices: each variable's slots and
compensation buffer are laid out over the mesh's data axis
(`kmp.core.low_bit.sharded_state`), and XLA updates each shard where it lies
and gathers the updated weights.

Limits: the compensation buffer has 8 significant bits too, so Kahan follows
float32 within a fraction of an ulp for varying updates but drifts by a few
ulps over ten thousand identical ones; stochastic rounding is unbiased, but
each weight's error is a random walk (about sqrt(steps * update / ulp) ulps).
"""

import random

import keras
from keras import ops

from kmp.core import backend
from kmp.core import borrow
from kmp.core import checks
from kmp.core.loss_scale import arguments as optimizer_arguments
from kmp.core.low_bit import arguments
from kmp.core.low_bit import parts
from kmp.core.low_bit import rounding
from kmp.core.low_bit import sharded_state
from kmp.core.low_bit import shared_step as step_shared
from kmp.core.low_bit import slots as quantized_slots
from kmp.core.low_bit import update as low_bit_update

# This backend's step (`apply_update`, `update_variable`, `view`) and random
# stream: the one place `LowPrecisionOptimizer` picks a backend.
if backend.is_tensorflow():
    from kmp.core.tensorflow import low_precision as _steps
    from kmp.core.tensorflow import rounding as _stream_module
elif backend.is_jax():
    from kmp.core.jax import low_precision as _steps
    from kmp.core.jax import rounding as _stream_module
else:
    from kmp.core.torch import low_precision as _steps
    from kmp.core.torch import rounding as _stream_module

ROUNDINGS = arguments.ROUNDINGS
SLOT_DTYPES = arguments.SLOT_DTYPES
QUANTIZED = arguments.QUANTIZED
UNSUPPORTED_INNER_OPTIONS = arguments.UNSUPPORTED_INNER_OPTIONS
check_seed = arguments.check_seed


@keras.saving.register_keras_serializable(package="kmp")
class LowPrecisionOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer: float32 updates of low-precision variables.

    See the module docstring for what each `rounding` does. Works on
    Keras's TensorFlow, JAX and torch backends: in `fit` and custom loops
    (eagerly, in `tf.function`, under XLA, in a jitted JAX loop over
    `stateless_apply`, in a torch loop after `backward()`), under
    `tf.distribute.MirroredStrategy` and `keras.distribution.DataParallel`
    (every replica rounds identically), and inside `kmp.LossScaleOptimizer`
    for float16 variables. Its compensation buffers and seed are in
    `variables`, so in `.keras` files and checkpoints, and the seed in its
    config; the stochastic stream follows the inner optimizer's
    `iterations`, so a resumed run is bit-identical to an uninterrupted one.

    Args:
        inner_optimizer: The Keras optimizer whose update is applied (any
            built-in one, or `kmp.FusedAdam` on TensorFlow, which then runs
            Keras's Adam update); not built yet, without `use_ema`,
            `gradient_accumulation_steps` or `loss_scale_factor`.
        rounding: `"kahan"` (default), `"stochastic"` or `"nearest"`: how a
            float32 result is written to a bfloat16 or float16 variable.
        slot_dtype: The dtype of every floating variable the inner optimizer
            creates for itself (moments, momentum, accumulators):
            `"bfloat16"`, `"float16"`, `"float32"`, or None (default) for
            each variable's own dtype, as Keras does, except that the
            slots of float16 variables are float32: a squared gradient
            (Adam's second moment) underflows float16, and training with
            float16 slots falls well short of float32's accuracy.
            `"bfloat16"` halves those slots (float32's range, 8
            significant bits); `"float16"` is for optimizers whose slots
            hold no squares (SGD's momentum), if at all. `"8bit"`: the
            moments of Adam, AdamW, Lion and SGD's momentum in a byte per
            element plus a float32 scale per block, for variables of
            `min_8bit_size` elements or more (others as with None);
            `"4bit"` in half a byte, `"float8"` as float8_e4m3fn
            (`kmp.core.low_bit.quantization`, `kmp.core.low_bit.codes`).
        block_size: With a quantized `slot_dtype`: elements per scale
            (default 256; 128 for `"4bit"`, which needs an even one).
        min_8bit_size: With a quantized `slot_dtype`: the smallest
            variable whose slots are quantized, in elements (default 4096).
        exclude_from_8bit: With a quantized `slot_dtype`: regular
            expressions; the slots of a variable whose path one matches
            keep their dtype.
        shard_state: True to split the optimizer state over the data axis
            of the `keras.distribution` in effect when the optimizer
            builds (JAX only; ZeRO stage 1): the state of each variable of
            4096 elements or more (slots in any `slot_dtype`, quantized
            codes and scales, compensation buffers) is laid out on one of
            its axes over the mesh's `batch_dim_name` axis, beside the
            model axes of its layout under `ModelParallel`, so each device
            holds and updates 1/N of it; the weights keep their layout,
            and the compiled step gathers their updates. Training gives
            the unsplit run's results within float32 rounding
            (`kmp.core.low_bit.sharded_state`). Default False.
        seed: The stochastic-rounding seed, an integer in [0, 2**63 - 1]
            (NumPy's too); None draws one from Python's `random` (seeded by
            `keras.utils.set_random_seed`), which the config then holds.
        name: The optimizer's name.

    Raises:
        TypeError: `inner_optimizer` is not a Keras optimizer or is a
            loss-scale or low-precision one; an argument has the wrong type.
        ValueError: an argument has a wrong value, or the inner optimizer
            is built or uses EMA, gradient accumulation or a loss scale;
            `shard_state=True` on TensorFlow or torch, or without a
            `keras.distribution` in effect. At build: `shard_state=True`
            and a variable of 4096 elements or more none of whose axes the
            data axis's devices divide.

    Example:

    >>> import kmp
    >>> with kmp.policy_scope("bfloat16"):
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> adam = keras.optimizers.Adam(0.1)
    >>> optimizer = kmp.LowPrecisionOptimizer(adam, seed=1)
    >>> model.compile(optimizer=optimizer, loss="mse")
    >>> x, y = keras.ops.ones((8, 4)), keras.ops.ones((8, 2))
    >>> losses = model.fit(x, y, epochs=5, verbose=0).history["loss"]
    >>> model.layers[0].kernel.dtype, losses[-1] < losses[0]
    ('bfloat16', True)
    >>> [(tuple(v.shape), v.dtype) for v in optimizer.variables
    ...  if "compensation" in v.name]
    [((4, 2), 'bfloat16'), ((2,), 'bfloat16')]
    >>> inner_variables = optimizer.inner_optimizer.variables
    >>> sorted({v.dtype for v in inner_variables if "float" in v.dtype})
    ['bfloat16', 'float32']
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        rounding: str = "kahan",
        slot_dtype=None,
        seed=None,
        name=None,
        block_size=None,
        min_8bit_size=None,
        exclude_from_8bit=None,
        shard_state=False,
    ):
        backend.check_supported("kmp.LowPrecisionOptimizer")
        arguments.check_shard_state(
            shard_state, backend.name(), keras.distribution.distribution()
        )
        plan = arguments.check_arguments(
            type(self),
            inner_optimizer,
            rounding,
            slot_dtype,
            seed,
            block_size=block_size,
            min_8bit_size=min_8bit_size,
            exclude=exclude_from_8bit,
        )
        super().__init__(learning_rate=0.0, name=name)
        self._inner_optimizer = inner_optimizer
        self._rounding = rounding
        self._slot_dtype = slot_dtype
        self._shard_state = shard_state
        self._streams = streams()
        seed = random.getrandbits(62) if seed is None else int(seed)
        with keras.name_scope(self.name, caller=self):
            self._seed = keras.Variable(
                self._streams.seed_value(seed),
                dtype=self._streams.SEED_DTYPE,
                trainable=False,
                aggregation="only_first_replica",
                name="seed",
            )
        self._compensations = []
        # Run-time caches, not state: past Keras's tracking.
        object.__setattr__(self, "_compiled", {})
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_located", {})
        object.__setattr__(self, "_plain_slots", {})
        object.__setattr__(self, "_split", None)

    @property
    def inner_optimizer(self) -> keras.optimizers.Optimizer:
        """The wrapped optimizer, which computes every update."""
        return self._inner_optimizer

    @property
    def rounding(self) -> str:
        """The rounding in use, `"kahan"`, `"stochastic"` or `"nearest"`."""
        return self._rounding

    @property
    def slot_dtype(self):
        """The inner optimizer's slot dtype, or None for each variable's."""
        return self._slot_dtype

    @property
    def shard_state(self) -> bool:
        """Whether the state is split over the data-parallel devices."""
        return self._shard_state

    @property
    def quantized(self) -> bool:
        """Whether any slot is 8-bit, 4-bit or float8 (once built)."""
        return bool(self._located)

    @property
    def seed(self) -> int:
        """The stochastic-rounding seed in use (a Python int)."""
        return self._streams.seed_of(ops.convert_to_numpy(self._seed))

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
        split = None
        if self._shard_state:
            split = sharded_state.split_of_distribution(
                quantized_slots.storage_of(self._plan)
            )
        if split is not None:
            split.check(var_list)  # Before anything is built.
        object.__setattr__(self, "_split", split)
        super().build(var_list)
        self._build_inner(var_list)
        kahan = self._rounding == "kahan"
        self._compensations = [
            self.add_variable_from_reference(
                sharded_state.reference(split, variable), "compensation"
            )
            if kahan and rounding.is_low(variable.dtype)
            else None
            for variable in var_list
        ]

    def _build_inner(self, var_list):
        inner = self._inner_optimizer
        slot_dtype = self._slot_dtype
        if slot_dtype in quantized_slots.SLOT_DTYPES:
            slot_dtype = None
        split = self._split
        if (
            self._plan is None
            and slot_dtype is None
            and split is None
            and not any(_is_float16(variable.dtype) for variable in var_list)
        ):
            inner.build(var_list)
            self._locate_plain()
            return
        original = inner.add_variable

        def add_variable(shape, initializer="zeros", dtype=None, **kwargs):
            if slot_dtype is None:
                # Each variable's dtype, float16's widened to float32.
                if _is_float16(dtype):
                    dtype = "float32"
            elif dtype is None or keras.backend.is_float_dtype(dtype):
                dtype = slot_dtype
            return original(shape, initializer, dtype, **kwargs)

        lent = {"add_variable": add_variable}
        slots = []
        builder = inner.add_variable_from_reference
        if split is not None:  # Slots laid out over the data axis.
            builder = sharded_state.plain_builder(split, builder)
            lent["add_variable_from_reference"] = builder
        if self._plan is not None:
            lent["add_variable_from_reference"] = quantized_slots.lent_builder(
                self._plan, inner, slots, builder, split
            )
        with borrow.lent(inner, **lent):
            inner.build(var_list)
        object.__setattr__(
            self, "_located", quantized_slots.locate(inner, slots)
        )
        self._locate_plain()

    def _locate_plain(self):
        """Where the inner optimizer keeps each variable's plain slots,
        for its update in parts (`kmp.core.low_bit.parts`; elementwise updates
        only)."""
        inner = self._inner_optimizer
        plain = {}
        if type(inner).update_step in quantized_slots.SUPPORTED:
            plain = parts.locate_plain(inner, self._located, rounding.is_low)
        object.__setattr__(self, "_plain_slots", plain)

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
                grads = step_shared.clip_gradients(inner, grads)
                _steps.apply_update(self, grads, variables)
                if self._split is not None:
                    self._keep_layouts(variables)
            inner._iterations.assign_add(1)

    def _keep_layouts(self, variables):
        """Lays each updated weight out as its variable, not as the split
        state it was computed from: in a jitted loop whose outputs have no
        shardings of their own, XLA would otherwise leave the weights
        split too, and the next step's forward pass would run on shards."""
        for variable in variables:
            layout = getattr(variable, "_layout", None)
            if layout is not None:
                value = keras.distribution.distribute_tensor(
                    variable.value, layout
                )
                variable.assign(value)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        # Keras's own sums every gradient in one all-reduce, which fails
        # for gradients of several dtypes (a float32 output layer beside
        # bfloat16 ones). A wrapper that summed them already lends `list`
        # in its place (kmp.core.borrow). Reached on TensorFlow only.
        return _steps.sum_over_replicas(grads_and_vars)

    def _update_step(self, gradient, variable, learning_rate):
        """The inner optimizer's `update_step`, in float32, then rounded.

        Lent to the inner optimizer as its `update_step` for a step: its
        own `_backend_update_step` calls it for each variable (Nadam's
        per-step work and `tf.distribute`'s per-device updates included).
        """
        index = self._get_variable_index(variable)
        _steps.update_variable(self, gradient, learning_rate, variable, index)

    def _update_one(self, gradient, learning_rate, variable, index):
        bounds = parts.bounds(self, index, _steps.update_in_parts)
        if bounds is None:
            self._update_part(gradient, learning_rate, variable, index)
        else:  # kmp.core.low_bit.parts
            _steps.update_in_parts(
                self, gradient, learning_rate, variable, index, bounds
            )

    def _update_part(self, gradient, learning_rate, variable, index, part=None):
        """Variable `index`'s update, or that of `part` of it (flat: a
        `kmp.core.low_bit.parts.Part`, whose `write` writes the results):
        `kmp.core.low_bit.update`, with this backend's step."""
        low_bit_update.update_part(
            self, _steps, gradient, learning_rate, variable, index, part
        )

    def _inner_var_key(self, variable):
        """The inner optimizer's `_var_key`, which finds a view's slots
        (lent to it for a step where keys are object ids: JAX, torch)."""
        if isinstance(variable, rounding.Float32View):
            variable = variable.variable
        inner = self._inner_optimizer
        return type(inner)._var_key(inner, variable)

    def load_own_variables(self, store):
        """Keras's, reading a seed saved on any backend as this one keeps it.

        Args:
            store: The saved values by position; a seed is one int64 on
                TensorFlow and torch, two uint32 words on JAX; quantized
                codes and scales saved flat (kmp before they took their
                variable's shape) are reshaped.
        """
        position = next(
            str(i) for i, v in enumerate(self.variables) if v is self._seed
        )
        if len(store.keys()) == len(self.variables):
            saved = store[position]
            if tuple(saved.shape) != tuple(self._streams.SEED_SHAPE):
                store = {key: store[key] for key in store.keys()}
                seed = rounding.seed_of_saved(saved)
                store[position] = self._streams.seed_value(seed)
            store = quantized_slots.reshaped_store(self, store)
        super().load_own_variables(store)

    def get_config(self) -> dict:
        """The settings, with the seed in use (drawn, if None was given).

        Returns:
            A dict of JSON-serializable values for `from_config`.
        """
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self._inner_optimizer
            ),
            "rounding": self._rounding,
            "slot_dtype": self._slot_dtype,
            "seed": self.seed,
            **quantized_slots.config(self._plan),
            # Only where set: configs of optimizers without it stay as
            # they were.
            **({"shard_state": True} if self._shard_state else {}),
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
        # A file saved with the state split loads anywhere (one device, any
        # backend): the state is split where a distribution is in effect at
        # build, as the weights follow it, and whole elsewhere.
        shard_state = config.pop("shard_state", False)
        optimizer = cls(inner, **config)
        if shard_state is True:
            optimizer._shard_state = True
        elif shard_state is not False:
            arguments.check_shard_state(shard_state, backend.name(), None)
        return optimizer


def _is_float16(dtype) -> bool:
    return dtype is not None and rounding.dtype_name(dtype) == "float16"


def streams():
    """This backend's random stream and seeds for stochastic rounding
    (`kmp.core.<backend>.rounding`)."""
    return _stream_module
