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
- If no layer of the model computes in float16 (a float32 model compiled or
  loaded while the global policy is `mixed_float16`), no loss scaling is
  added at all, so the saved optimizer state of a float32 model fits.

A `LossScaleOptimizer` the user passes (Keras's or kmp's) is kept as it is.
"""

import inspect

import keras
from keras.src.trainers import trainer as _keras_trainer

from kmp.core import optimizer as optimizer_module
from kmp.patches import registry

_KerasLossScaleOptimizer = keras.optimizers.LossScaleOptimizer


def computes_in_float16(model):
    """Whether any layer of `model` computes in float16 (None: no layers)."""
    layers = [
        layer
        for layer in model._flatten_layers(include_self=False)
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    if not layers:
        return None
    return any(
        getattr(layer.dtype_policy, "compute_dtype", None) == "float16"
        for layer in layers
    )


def compile(original, self, *args, **kwargs):  # noqa: A001 - Keras's name.
    """Keras's `Model.compile`; its own loss-scale wrapper becomes kmp's."""
    arguments = inspect.signature(original).bind(self, *args, **kwargs)
    given = arguments.arguments.get("optimizer", "rmsprop")
    original(self, *args, **kwargs)
    chosen = getattr(self, "optimizer", None)
    if type(chosen) is not _KerasLossScaleOptimizer or chosen is given:
        return
    if computes_in_float16(self) is False:
        self.optimizer = chosen.inner_optimizer
        return
    wrapper = optimizer_module.LossScaleOptimizer(
        chosen.inner_optimizer, name=chosen.name
    )
    wrapper.keras_file_layout = True
    self.optimizer = wrapper


def _works() -> bool:
    current = _keras_trainer.Trainer.__dict__["compile"]
    parameters = inspect.signature(registry.keras_original(current)).parameters
    return "optimizer" in parameters and "auto_scale_loss" in parameters


PATCH = registry.Patch(
    name="compile",
    kind=registry.BEHAVIOUR,
    summary=(
        "model.compile's automatic loss scaling (mixed_float16) wraps the "
        "optimizer in kmp.LossScaleOptimizer, saved in Keras's file layout, "
        "and adds none to a model without float16 layers"
    ),
    targets=lambda: [
        registry.Target(_keras_trainer.Trainer, "compile", compile)
    ],
    check=_works,
)
