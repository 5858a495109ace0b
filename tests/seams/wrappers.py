"""The matrix's first axis: every optimizer wrapper kmp has, as data.

Not a test module. A `Wrapper` is one configuration a user can train with,
in one nesting order: how to build the compiled model (a factory), the
global policy it runs under, whether it skips non-finite steps (then a cell
feeds it one NaN batch), and the plain optimizer it must equal bit for bit on
the finite steps where kmp claims that (README: "train exactly like the
float32 reference"; `kmp.LowPrecisionOptimizer`: float32 variables are
"the inner optimizer's, bit for bit"). A configuration kmp refuses names the
error the user's call raises instead.

The configurations: `lso_<knobs>` (each knob set of `KNOBS`), `lpo_<rounding>`
(each rounding), `lpo_8bit` and `lso_lpo_8bit` (8-bit moments),
`fused_adam`, two wrappers nested (the outer one first:
`lso_lpo_<rounding>`, float16 weights with each rounding; the reverse orders
are refused), `convert_<policy>` (convert's result) and `compile_auto`
(compile's auto-wrap); for the callbacks' cells also `lso_accumulating`
(an inner optimizer that accumulates gradients).
"""

import dataclasses
from typing import Callable
from typing import Optional

import keras

import kmp
from tests.support import training


def adam():
    return keras.optimizers.Adam(0.01)


def fused_adam():
    return kmp.FusedAdam(0.01)


def accumulating_adam():
    """Adam updating once every two steps (Keras's `iterations` is then a
    tensor computed from the steps applied)."""
    return keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)


# The knob sets of kmp.LossScaleOptimizer: every setting, each with values
# exact in float32 (powers of two), so a float32 model still trains like
# the float32 reference. Values that round in float32 are the numeric
# fuzzing's (tests/adversarial/test_optimizer_arguments.py).
KNOBS = {
    "default": {},
    "fixed": {"dynamic": False, "initial_scale": 128},
    "growth": {
        "initial_scale": 2**10,
        "dynamic_growth_steps": 1,
        "growth_factor": 4,
        "backoff_factor": 0.25,
    },
    "bounds": {
        "initial_scale": 16,
        "dynamic_growth_steps": 1,
        "min_scale": 8,
        "max_scale": 32,
    },
    "hysteresis": {
        "initial_scale": 64,
        "dynamic_growth_steps": 2,
        "hysteresis": 2,
    },
    "skips": {
        "initial_scale": 64,
        "max_consecutive_skips": 2,
        "on_persistent_skips": "raise",
        "record_nonfinite": True,
    },
}


def lso(inner=adam, **knobs):
    return lambda: kmp.LossScaleOptimizer(inner(), **knobs)


def lpo(rounding, inner=adam, seed=1, slot_dtype=None):
    return lambda: kmp.LowPrecisionOptimizer(
        inner(), rounding, slot_dtype, seed
    )


def lpo_8bit(rounding, seed=1, slot_dtype="8bit"):
    """Quantized moments (8-bit by default; `"4bit"`, `"float8"`) on every
    variable of the cells' small models (blocks of 8 elements: several
    blocks and padding)."""
    return lambda: kmp.LowPrecisionOptimizer(
        adam(),
        rounding,
        slot_dtype=slot_dtype,
        seed=seed,
        block_size=8,
        min_8bit_size=1,
    )


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """One configuration a cell trains with (see the module docstring).

    Attributes:
        name: The id in test names (`lso_growth`, `lso_lpo_kahan`: the
            outer wrapper first).
        policy: The global policy the cell runs under.
        optimizer: Makes the optimizer `model.compile` gets, or None for
            `build` to make the compiled model itself.
        skips: Whether it skips a non-finite step (it holds a loss scale).
        reference: Makes the plain optimizer it equals bit for bit on the
            finite steps (the same model and policy), or None: no claim.
        refused: The `Refusal` its construction meets, or None.
        build: `build(compile_kwargs)` makes the compiled model where
            `optimizer` is None (convert's result).
        needs_fused_adam: Whether it needs `kmp.FusedAdam` (TensorFlow's
            and torch's): on JAX its construction is refused, as
            documented.
    """

    name: str
    policy: str
    optimizer: Optional[Callable] = None
    skips: bool = False
    reference: Optional[Callable] = None
    refused: Optional["Refusal"] = None
    build: Optional[Callable] = None
    needs_fused_adam: bool = False

    def refusal(self, backend_name):
        """The `Refusal` a cell checks on backend `backend_name`, or None."""
        if self.needs_fused_adam and backend_name == "jax":
            return Refusal(
                RuntimeError,
                "needs Keras's TensorFlow or torch backend",
                None,
                lambda _: self.optimizer(),
            )
        return self.refused

    def compiled_model(self, compile_kwargs):
        """A new model compiled with this configuration (under the policy
        and strategy the caller set up)."""
        if self.build is not None:
            return self.build(compile_kwargs)
        model = training.model()
        model.compile(optimizer=self.optimizer(), loss="mse", **compile_kwargs)
        return model


@dataclasses.dataclass(frozen=True)
class Refusal:
    """`call(inner())` must raise `error` matching `match` and leave the
    optimizer `inner()` made (None: nothing made first) as it was."""

    error: type
    match: str
    inner: Optional[Callable]
    call: Callable


def converted(policy):
    """`kmp.convert` of a compiled float32 model to `policy`: the copy
    comes compiled with the optimizer convert chose."""

    def build(compile_kwargs):
        model = training.model()
        model.compile(optimizer=adam(), loss="mse", **compile_kwargs)
        return kmp.convert(model, policy)

    return build


WRAPPERS = [
    *[
        Wrapper(
            f"lso_{knobs}",
            "float32",
            lso(**settings),
            skips=True,
            reference=adam,
        )
        for knobs, settings in KNOBS.items()
    ],
    Wrapper("lpo_kahan", "bfloat16", lpo("kahan")),
    # seed=None (the default): the seed drawn is state to restore.
    Wrapper("lpo_stochastic", "bfloat16", lpo("stochastic", seed=None)),
    # Float32 variables: the inner optimizer's update, bit for bit.
    Wrapper("lpo_nearest", "mixed_bfloat16", lpo("nearest"), False, adam),
    Wrapper(
        "fused_adam",
        "mixed_bfloat16",
        fused_adam,
        needs_fused_adam=True,
    ),
    Wrapper(
        "lso_fused_adam",
        "float32",
        lso(fused_adam, **KNOBS["growth"]),
        skips=True,
        reference=fused_adam,
        needs_fused_adam=True,
    ),
    # The documented order for float16 variables, with every rounding:
    # slots in bfloat16 (where Adam's squared gradients do not underflow),
    # or by default in float32.
    Wrapper(
        "lso_lpo_kahan",
        "float16",
        lso(lpo("kahan", slot_dtype="bfloat16"), **KNOBS["growth"]),
        skips=True,
    ),
    Wrapper(
        "lso_lpo_stochastic",
        "float16",
        lso(lpo("stochastic"), **KNOBS["growth"]),
        skips=True,
    ),
    Wrapper(
        "lso_lpo_nearest",
        "float16",
        lso(lpo("nearest"), **KNOBS["growth"]),
        skips=True,
    ),
    # 8-bit optimizer state: bfloat16 weights, and float16 weights under
    # loss scaling.
    Wrapper("lpo_8bit", "bfloat16", lpo_8bit("stochastic")),
    Wrapper(
        "lso_lpo_8bit",
        "float16",
        lso(lpo_8bit("kahan"), **KNOBS["growth"]),
        skips=True,
    ),
    # 4-bit and float8 state, the same two ways.
    Wrapper("lpo_4bit", "bfloat16", lpo_8bit("stochastic", slot_dtype="4bit")),
    Wrapper(
        "lso_lpo_float8",
        "float16",
        lso(lpo_8bit("kahan", slot_dtype="float8"), **KNOBS["growth"]),
        skips=True,
    ),
    Wrapper(
        "lpo_stochastic_fused_adam",
        "bfloat16",
        lpo("stochastic", inner=fused_adam),
        needs_fused_adam=True,
    ),
    Wrapper(
        "lpo_lso",
        "float32",
        refused=Refusal(
            TypeError,
            "LossScaleOptimizer",
            lso(),
            lambda inner: kmp.LowPrecisionOptimizer(inner),
        ),
    ),
    Wrapper(
        "lso_lso",
        "float32",
        refused=Refusal(
            TypeError,
            "LossScaleOptimizer",
            lso(),
            lambda inner: kmp.LossScaleOptimizer(inner),
        ),
    ),
    Wrapper(
        "lpo_lpo",
        "float32",
        refused=Refusal(
            TypeError,
            "LowPrecisionOptimizer",
            lpo("kahan"),
            lambda inner: kmp.LowPrecisionOptimizer(inner),
        ),
    ),
    Wrapper(
        "convert_mixed_float16",
        "float32",
        skips=True,
        build=converted("mixed_float16"),
    ),
    Wrapper("convert_bfloat16", "float32", build=converted("bfloat16")),
    # compile's auto-wrap: mixed_float16 and a plain optimizer.
    Wrapper("compile_auto", "mixed_float16", adam, skips=True),
]


# Configurations only the callbacks' cells train with (tests/seams/
# test_callbacks.py): the round trips of the matrix count one update per
# step.
CALLBACK_WRAPPERS = [
    Wrapper(
        "lso_accumulating",
        "float32",
        lso(accumulating_adam, **KNOBS["growth"]),
        skips=True,
    ),
]


def by_name(name) -> Wrapper:
    (found,) = [
        wrapper
        for wrapper in WRAPPERS + CALLBACK_WRAPPERS
        if wrapper.name == name
    ]
    return found


def optimizer_chain(optimizer):
    """The class names from the outer optimizer to the innermost one."""
    chain = [type(optimizer).__name__]
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
        chain.append(type(optimizer).__name__)
    return chain


def innermost(optimizer):
    """The optimizer that computes the update (past every wrapper)."""
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def loss_scale_optimizer(optimizer):
    """The kmp.LossScaleOptimizer in `optimizer`'s chain, or None."""
    while optimizer is not None:
        if isinstance(optimizer, kmp.LossScaleOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None
