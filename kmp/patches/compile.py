"""Patch `compile`: Keras's automatic loss scaling uses kmp's optimizer.

Under the `mixed_float16` policy, `model.compile(optimizer="adam")` wraps
the optimizer in Keras's own `LossScaleOptimizer` (`auto_scale_loss=True`).
With this patch that wrapper is a `kmp.LossScaleOptimizer` instead, with
the same settings (dynamic, 2**15, 2000 steps), so training gets kmp's
guarantees: a scale never below 1 nor inf, skipped steps that leave
`iterations` alone, the same skips on every replica. Two more things:

- The compile config keeps what the user passed (`"adam"`), and the
  optimizer writes `.keras` files in Keras's own layout, so a model built
  and compiled with Keras names only loads in Keras without kmp, scale and
  counter included; with kmp, the same file restores into kmp's optimizer.
- Keras decides by the model's own policy; kmp by its layers. A model of
  `mixed_float16` layers gets loss scaling also when its own policy is
  float32 (saved under `mixed_float16`, loaded while the global policy is
  float32), and one whose layers compute in no float16 gets none (a float32
  model loaded while the global policy is `mixed_float16`): either way the
  saved optimizer state fits.

A `LossScaleOptimizer` the user passes (Keras's or kmp's) is kept as it is.

With a kmp optimizer, a step `fit` skips also leaves the model's
non-trainable variables (`model.non_trainable_variables`: BatchNormalization's
moving statistics, seed-generator states, anything a layer assigns in its
training call) as they were before the step, bit for bit: Keras's
`train_step` runs inside `optimizer.keep_on_skip(...)` on TensorFlow and
torch, and on JAX its non-trainable values go through
`optimizer.stateless_keep_on_skip(...)`. Metrics are not restored: they
record the step's loss, inf or NaN, as Keras's own loss-scale optimizer
does, so the logs show the overflow. A model whose `train_step` is its own
(not calling Keras's) does this with the same two calls.

Where a kmp optimizer's step cannot report persistent skips from inside
itself (`jit_compile=True` on TensorFlow: XLA runs no Python; every JAX
step, whose state is lost if it raises, jitted or not), `fit`'s train
function checks after every call, without waiting for the device: the JAX
step and TensorFlow's XLA step return their skips in a row and scale
packed in one small array (taken out of the logs before Keras sees them;
under a `tf.distribute` strategy TensorFlow's are packed after the call),
and each is read one step later (`kmp.core.loss_scale.lagged`). So the
warning appears and "raise" stops `fit` one step after the step that
reaches the limit (on every process at the same step), with the state of
the step just run kept (on JAX assigned to the variables before it
raises), with or without `LossScaleMonitor`; `check_persistent_skips_now()`
reports on the last step of a `fit` at once.
"""

import importlib
import inspect

import keras
from keras.src.trainers import trainer as _keras_trainer

from kmp.core import backend
from kmp.core import optimizer as optimizer_module
from kmp.core import policy as core_policy
from kmp.core.loss_scale import keep_on_skip as kept_state
from kmp.core.loss_scale import lagged
from kmp.patches import registry

# The logs entry of a step (JAX's; TensorFlow's under XLA) that holds its
# persistent-skips numbers.
SKIPS_KEY = "_kmp_persistent_skips"

_KerasLossScaleOptimizer = keras.optimizers.LossScaleOptimizer


def _layer_policies(model):
    return [
        core_policy.layer_policy(layer)
        for layer in model._flatten_layers(include_self=False)
        if not isinstance(layer, keras.layers.InputLayer)
    ]


def computes_in_float16(model):
    """Whether any layer of `model` computes in float16 (None: no layers)."""
    policies = _layer_policies(model)
    if not policies:
        return None
    return any(
        getattr(policy, "compute_dtype", None) == "float16"
        for policy in policies
    )


def _has_mixed_float16_layers(model) -> bool:
    return any(
        getattr(policy, "name", None) == "mixed_float16"
        for policy in _layer_policies(model)
    )


def _kmp_wrapper(inner, name):
    wrapper = optimizer_module.LossScaleOptimizer(inner, name=name)
    wrapper.keras_file_layout = True
    return wrapper


def compile(original, self, *args, **kwargs):  # noqa: A001 - Keras's name.
    """Keras's `Model.compile`; its own loss-scale wrapper becomes kmp's."""
    arguments = inspect.signature(original).bind(self, *args, **kwargs)
    given = arguments.arguments.get("optimizer", "rmsprop")
    automatic = arguments.arguments.get("auto_scale_loss", True)
    original(self, *args, **kwargs)
    chosen = getattr(self, "optimizer", None)
    if chosen is None or not automatic:
        return
    if type(chosen) is _KerasLossScaleOptimizer and chosen is not given:
        # Keras wrapped it: the model's own policy is mixed_float16.
        if computes_in_float16(self) is False:
            self.optimizer = chosen.inner_optimizer
        else:
            self.optimizer = _kmp_wrapper(chosen.inner_optimizer, chosen.name)
    elif not isinstance(
        chosen, _KerasLossScaleOptimizer
    ) and _has_mixed_float16_layers(self):
        # Keras looks at the model's policy only; a mixed_float16 model
        # loaded while the global policy is float32 has float32 there.
        self.optimizer = _kmp_wrapper(chosen, "loss_scale_optimizer")


def _needs_skip_check(model) -> bool:
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, optimizer_module.LossScaleOptimizer):
        return False
    if optimizer.max_consecutive_skips is None:
        return False
    if backend.is_jax():
        return True  # Every JAX step is pure, jitted or not.
    return bool(model.jit_compile) and not model.run_eagerly


def make_train_function(original, self, force=False):
    """Keras's `make_train_function`; under XLA (and on JAX) it checks
    persistent skips after every call of the train function (see the
    module docstring)."""
    returned = original(self, force=force)
    function = self.train_function
    if (
        function is not None
        and not getattr(function, "__kmp_checks_skips__", False)
        and _needs_skip_check(self)
    ):
        optimizer = self.optimizer

        def train_function(*args, **kwargs):
            if not backend.is_jax():
                outputs = function(*args, **kwargs)
                packed = None
                if isinstance(outputs, dict):
                    packed = outputs.pop(SKIPS_KEY, None)
                steps = self.steps_per_execution
                if packed is None:  # A train_step of the model's own.
                    optimizer._check_persistent_skips(steps=steps)
                else:
                    optimizer._check_persistent_skips_packed(packed, steps)
                return outputs
            # A step that runs eagerly (run_eagerly, jit_compile=False)
            # would raise inside, losing the state it returns: it leaves
            # the report to this check. (logs, state).
            with optimizer._skips_reported_after_step():
                outputs = function(*args, **kwargs)
            packed = outputs[0].pop(SKIPS_KEY, None)
            steps = self.steps_per_execution
            try:
                if packed is None:  # A train_step of the model's own.
                    optimizer._check_persistent_skips(outputs[1][2], steps)
                else:
                    optimizer._check_persistent_skips_packed(packed, steps)
            except FloatingPointError:
                _write_back(self, outputs[1])
                raise
            return outputs

        train_function.__kmp_checks_skips__ = True
        self.train_function = train_function
        if returned is function:
            returned = train_function
    return returned


def fit(original, self, *args, **kwargs):
    """Keras's `fit`; where a kmp optimizer's check comes a step late (see
    `make_train_function`), the last step of `fit` is checked at its end,
    once Keras has read the logs of the epoch. A `fit` that raises (for
    persistent skips, or anything else) drops the checks of its steps it
    had not read yet: no report crosses into a later call."""
    return _checked_at_the_end(original, self, *args, **kwargs)


def train_on_batch(original, self, *args, **kwargs):
    """Keras's `train_on_batch`, which reads its logs anyway: the step is
    checked at once (see `fit`)."""
    return _checked_at_the_end(original, self, *args, **kwargs)


def _checked_at_the_end(original, model, *args, **kwargs):
    """`original(model, ...)`, then the persistent-skips check of every
    step it left unread; the unread ones are dropped however it ends."""
    try:
        result = original(model, *args, **kwargs)
        if _needs_skip_check(model):
            model.optimizer.check_persistent_skips_now()
        return result
    finally:
        if _needs_skip_check(model):
            model.optimizer._discard_pending_skip_checks()


def train_step(original, self, data):
    """Keras's `train_step` (TensorFlow, torch); under a kmp optimizer a
    skipped step leaves the model's non-trainable variables as they were
    (see the module docstring)."""
    optimizer = getattr(self, "optimizer", None)
    if not isinstance(optimizer, optimizer_module.LossScaleOptimizer):
        return original(self, data)
    variables = [
        v for v in self.non_trainable_variables if not kept_state.is_exempt(v)
    ]
    if not variables:
        logs = original(self, data)
    else:
        with optimizer.keep_on_skip(variables):
            logs = original(self, data)
    return _with_packed_skips(self, optimizer, logs)


def _with_packed_skips(model, optimizer, logs):
    """`logs` and, in a TensorFlow step that XLA compiles (whose numbers
    `make_train_function`'s check reads after the call) outside any
    `tf.distribute` strategy, the step's skips in a row and scale packed
    under `SKIPS_KEY`: the check then takes them from the call's outputs,
    with no operation of its own after each step (packing them eagerly
    after the call added 0.1x to the step of a 202-variable model,
    `benchmarks/step_costs.py`). Under a strategy Keras would average the
    replicas' numbers: the check reads the variables there."""
    if not (backend.is_tensorflow() and isinstance(logs, dict)):
        return logs
    tf = backend.tensorflow()
    if tf.executing_eagerly() or tf.distribute.has_strategy():
        return logs
    if not _needs_skip_check(model):
        return logs
    logs = dict(logs)
    logs[SKIPS_KEY] = lagged.pack(
        optimizer.consecutive_skips_variable.value,
        optimizer.dynamic_scale.value,
    )
    return logs


def stateless_train_step(original, self, state, data):
    """Keras's JAX `train_step`, a pure function of the state; under a kmp
    optimizer the non-trainable values it returns after a skipped step are
    those it was given."""
    logs, new_state = original(self, state, data)
    optimizer = getattr(self, "optimizer", None)
    kmp_optimizer = isinstance(optimizer, optimizer_module.LossScaleOptimizer)
    if not kmp_optimizer:
        return logs, new_state
    trainable, non_trainable, optimizer_values, metrics = new_state
    if optimizer.max_consecutive_skips is not None and isinstance(logs, dict):
        # For the check after the step (make_train_function), which takes
        # it out of the logs: a new array, not donated with the state.
        logs = dict(logs)
        logs[SKIPS_KEY] = lagged.pack(*optimizer._skip_values(optimizer_values))
    if not state[1]:
        return logs, new_state
    # An exempt variable's value after the step is kept either way.
    before = [
        after if kept_state.is_exempt(variable) else value
        for variable, value, after in zip(
            self.non_trainable_variables, state[1], non_trainable
        )
    ]
    non_trainable = optimizer.stateless_keep_on_skip(
        optimizer_values, before, non_trainable
    )
    return logs, (trainable, non_trainable, optimizer_values, metrics)


def _write_back(model, state):
    """Assigns a JAX train step's state to the model's variables when the
    step's check raises: the step donated the buffers of the state it was
    given (`fit` and `train_on_batch` would keep those), and `fit` stops
    mid-epoch. `fit` finds the state synced and leaves it."""
    names = (
        "trainable_variables",
        "non_trainable_variables",
        "optimizer_variables",
        "metrics_variables",
    )
    model._jax_state = dict(zip(names, state))
    model._jax_state_synced = False
    model.jax_state_sync()


def _backend_trainer():
    """Keras's trainer class of the backend it runs on."""
    module = importlib.import_module(
        f"keras.src.backend.{backend.name()}.trainer"
    )
    names = {
        "tensorflow": "TensorFlowTrainer",
        "jax": "JAXTrainer",
        "torch": "TorchTrainer",
    }
    return getattr(module, names[backend.name()])


def _trainer_targets():
    trainer = _backend_trainer()
    step = stateless_train_step if backend.is_jax() else train_step
    targets = [
        registry.Target(_keras_trainer.Trainer, "compile", compile),
        registry.Target(trainer, "train_step", step),
    ]
    if backend.is_tensorflow() or backend.is_jax():
        targets += [
            registry.Target(
                trainer, "make_train_function", make_train_function
            ),
            registry.Target(trainer, "fit", fit),
            registry.Target(trainer, "train_on_batch", train_on_batch),
        ]
    return targets


def _works() -> bool:
    current = _keras_trainer.Trainer.__dict__["compile"]
    parameters = inspect.signature(registry.keras_original(current)).parameters
    step = _backend_trainer().__dict__["train_step"]
    step_parameters = list(
        inspect.signature(registry.keras_original(step)).parameters
    )
    expected = ["self", "data"]
    if backend.is_jax():
        expected = ["self", "state", "data"]
    return (
        "optimizer" in parameters
        and "auto_scale_loss" in parameters
        and step_parameters == expected
    )


PATCH = registry.Patch(
    name="compile",
    kind=registry.BEHAVIOUR,
    summary=(
        "model.compile's automatic loss scaling (mixed_float16) wraps the "
        "optimizer in kmp.LossScaleOptimizer, saved in Keras's file layout, "
        "and adds none to a model without float16 layers; with kmp's "
        "optimizer a step fit skips leaves the model's non-trainable "
        "variables as they were; under XLA (and on JAX) fit checks kmp's "
        "persistent skips a step after each step and at its end, and "
        "train_on_batch after its step"
    ),
    targets=_trainer_targets,
    check=_works,
)
