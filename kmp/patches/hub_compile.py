"""Patch `compile_from_config`: a keras-hub task compiles as it was saved.

keras-hub's tasks (`GPT2CausalLM`, `BertTextClassifier`, ...) override
`compile()` to give its arguments task defaults (`optimizer="auto"`,
`loss="auto"`); the defaults resolved, they call Keras's `compile` with
the same arguments any model takes, and Keras records those as the compile
config. Keras's `compile_from_config` will not call an overridden
`compile` (it cannot know its arguments), so a `.keras` file of a compiled
task loads with the default `compile` its constructor ran instead (keras-hub
0.32: `Adam(2e-5)`), and the optimizer state in the file (the loss scale
and counters of a `kmp.LossScaleOptimizer`, the codes of 8-bit state, the
moments) is dropped with a warning: the user's optimizer is gone.

With this patch a model whose `compile` is keras-hub's own (a task of
keras-hub's, or a subclass that does not override `compile` again) is
compiled from its compile config the way Keras compiles other models:
`model.compile(**config)`, then the optimizer is built, so the file's
optimizer state loads into it. Every other model with a custom `compile`
gets Keras's warning, as without kmp.
"""

import inspect

from keras.src.saving import serialization_lib
from keras.src.trainers import trainer as _keras_trainer

from kmp.patches import registry


def compile_from(model, config, before_build=None, **extra) -> None:
    """`model.compile(**config, **extra)` from a compile config, then the
    optimizer built, as Keras's `compile_from_config` does for a model
    whose `compile` is Keras's. `before_build(optimizer)`, if given, is
    called between the two (to set what must be set before the optimizer
    is built, such as its weight-decay exclusions)."""
    config = serialization_lib.deserialize_keras_object(config)
    model.compile(**config, **extra)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and before_build is not None:
        before_build(optimizer)
    if optimizer is not None and model.built:
        optimizer.build(model.trainable_variables)


def is_hub_compile(cls) -> bool:
    """Whether `cls.compile` is keras-hub's own (a task's), whose arguments
    are Keras's compile's, task defaults aside."""
    for klass in inspect.getmro(cls):
        if "compile" in vars(klass):
            return (klass.__module__ or "").startswith("keras_hub.")
    return False


def compile_from_config(original, self, config):
    """Keras's, but a keras-hub task is compiled from `config` too."""
    if not is_hub_compile(type(self)):
        return original(self, config)
    compile_from(self, config)


def _targets():
    return [
        registry.Target(
            _keras_trainer.Trainer, "compile_from_config", compile_from_config
        )
    ]


def _works() -> bool:
    current = _keras_trainer.Trainer.__dict__["compile_from_config"]
    parameters = list(
        inspect.signature(registry.keras_original(current)).parameters
    )
    return parameters == ["self", "config"]


PATCH = registry.Patch(
    name="hub_compile",
    kind=registry.BEHAVIOUR,
    summary=(
        "a keras-hub task (whose compile() gives task defaults) compiles "
        "from the compile config of a .keras file as other models do, so "
        "its optimizer and that optimizer's state (loss scale, counters, "
        "8-bit state, moments) load back; other models with a custom "
        "compile() keep Keras's warning"
    ),
    targets=_targets,
    check=_works,
)
