"""`convert`: the same model, with the same weights, under another policy.

`convert(model, "mixed_float16")` rebuilds a Sequential or Functional model
layer by layer with `keras.models.clone_model`, giving every floating layer the
new policy, and copies the weights across unchanged. Some layers stay float32
on purpose:

* the layers whose outputs are the model's outputs, so the model still returns
  float32 (losses and metrics then run in float32). Keeping the last layer in
  float32 rather than appending a cast keeps the architecture, and with it the
  layer list and the weights, exactly as they were;
* standalone softmax layers (`Softmax`, `Activation("softmax")` and
  `"log_softmax"`), whose exponentials over- and underflow in float16;
* the layers you name in `keep_float32`.

`keras.ops` calls in the model (`x * 2`, `x[:, 0]`, `keras.ops.cast`) have no
policy and are copied as they are: each computes in the dtype its inputs
arrive in. An output computed by such calls keeps the layers feeding them in
float32.

A Functional subclass that builds its graph in its constructor (a keras-hub
backbone or task such as `GPT2CausalLM`) is rebuilt from its config instead,
as its own class (`kmp.tools.convert.rebuild`).

`BatchNormalization` is *not* kept in float32: under a mixed policy its
variables are float32 already and Keras computes its statistics and the
normalization in float32 internally (it upcasts its inputs and casts the result
back), so float32 would only add a cast. `LayerNormalization` does the same.
"""

import warnings

import keras

from kmp.core.policy import PolicyLike
from kmp.core.policy import as_policy as _to_policy
from kmp.core.policy import policy_scope
from kmp.tools import models
from kmp.tools.convert import fine_tuning
from kmp.tools.convert import optimizer as convert_optimizer
from kmp.tools.convert import rebuild
from kmp.tools.convert.keep_float32 import KeepFloat32
from kmp.tools.convert.keep_float32 import default_float32_layers
from kmp.tools.convert.keep_float32 import selected_layers


def convert(
    model: keras.Model,
    policy: PolicyLike,
    keep_float32: KeepFloat32 = (),
    *,
    rounding=convert_optimizer.DEFAULT,
    slot_dtype=convert_optimizer.DEFAULT,
    seed=convert_optimizer.DEFAULT,
) -> keras.Model:
    """Returns a copy of `model` whose layers run under `policy`.

    The copy has the same architecture, layer names and weights; the original
    model is left untouched. Every layer with a floating policy gets `policy`,
    except (when `policy` computes in float16 or bfloat16) the layers that
    produce the model's outputs, standalone softmax layers, and the layers
    selected by `keep_float32`, which get `"float32"`. Layers with
    non-floating policies (lookup layers, for one) keep theirs.

    Weights are copied bit for bit when the variable dtype does not change
    (float32 <-> `"mixed_float16"` / `"mixed_bfloat16"`); under `"float16"` or
    `"bfloat16"` they are rounded to that dtype; every variable of the copy
    is a buffer of its own, never one of the model's. A compiled model
    gives a copy compiled like it (loss, metrics, `jit_compile`, ...) with a
    new optimizer of the model's class and settings (its training state is
    not copied), also for a class whose `compile` is its own (a keras-hub
    task keeps the user's optimizer, not the task's default): loss scaling
    is added when converting to `"mixed_float16"`, and a loss-scale
    optimizer is unwrapped when converting to a policy that does not
    compute in float16. Converting a compiled model to `"bfloat16"`
    (bfloat16 weights, half the memory of mixed precision) wraps the new
    optimizer in `kmp.LowPrecisionOptimizer` with Kahan compensation, so
    the copy still trains (see `guides/bfloat16_weights.py`); its compile
    config names the wrapper, so a saved copy loads with it and its state.

    A model being fine-tuned converts as it is (`fine_tuning`): layers with
    LoRA (`enable_lora`) have it on the copy with the same rank, alpha and
    weights, frozen layers and variables are frozen, and the new optimizer
    is built for the copy's trainable variables, with the model's
    optimizer's weight-decay exclusions (`exclude_from_weight_decay`).
    Enable LoRA before converting: LoRA enabled on the copy needs the copy
    compiled again, as for any model whose optimizer is built.

    Args:
        model: A Sequential or Functional model (a keras-hub backbone or
            task too). Nested Sequential and Functional models are converted
            layer by layer too.
        policy: The target policy: a name such as `"mixed_float16"` or a
            `kmp.Policy`.
        keep_float32: Layers to keep in float32: layer names, glob patterns
            matched against layer names (`"block*_bn"`), or layer classes
            (`keras.layers.LayerNormalization`). A list, or a single entry.
            The name of a nested model keeps all of its layers in float32.
        rounding: Only for `"bfloat16"`: how the compiled copy's optimizer
            rounds its updates into the bfloat16 weights: `"kahan"` (the
            default), `"stochastic"` or `"nearest"` (see
            `kmp.LowPrecisionOptimizer`), or None for Keras's own update
            (which stalls once updates fall below half a bfloat16 ulp).
        slot_dtype: Only for `"bfloat16"`: the dtype of the optimizer's
            slots (`"bfloat16"` halves them; `"8bit"`, `"4bit"` or
            `"float8"`: quantized moments for Adam, AdamW, Lion and SGD,
            see `kmp.LowPrecisionOptimizer`),
            default the weights'.
        seed: Only for `"bfloat16"`: the stochastic-rounding seed, an
            integer in [0, 2**63 - 1] (NumPy's too); None draws one.

    Returns:
        A new `keras.Model` of the same class.

    Raises:
        TypeError: `model` is subclassed (rebuild it under `kmp.policy_scope`
            and load the weights instead) or not a model; `policy` or an
            entry of `keep_float32` has the wrong type.
        ValueError: `rounding`, `slot_dtype` or `seed` is given for a
            policy other than `"bfloat16"` or is not allowed; the model's
            optimizer uses EMA, gradient accumulation or a loss-scale factor,
            which `LowPrecisionOptimizer` does not support (the message
            says what to do instead); `policy` is no floating policy; a
            name or pattern in `keep_float32` matches no layer (the message
            lists the layers); a layer is quantized; `model` is not built;
            a layer cannot be rebuilt from its config (a Lambda layer, for
            one; the message names it and says what to do instead).

    Example:

    >>> model = keras.Sequential(
    ...     [keras.Input((4,)), keras.layers.Dense(8, name="hidden"),
    ...      keras.layers.Dense(2, name="logits")]
    ... )
    >>> mixed = convert(model, "mixed_float16")
    >>> [layer.dtype_policy.name for layer in mixed.layers]
    ['mixed_float16', 'float32']
    >>> mixed.outputs[0].dtype
    'float32'
    """
    policy = _to_policy(policy, "policy")
    wraps = convert_optimizer.check(policy, rounding, slot_dtype, seed)
    if wraps and getattr(model, "compiled", False):
        convert_optimizer.check_optimizer(model)
    models.check_graph_model(model, "convert")
    models.check_built(
        model, "convert", "cannot tell which layers give its outputs"
    )
    named_ids = selected_layers(model, keep_float32)
    layers = models.leaf_layers(model)
    for layer in layers:
        if models.layer_policy(layer).quantization_mode is not None:
            raise ValueError(
                f"Layer {layer.name!r} is quantized (policy "
                f"{models.layer_policy(layer).name!r}); kmp.convert() "
                "changes only floating policies. Convert the model before "
                "quantizing it."
            )
    float32_ids = set(named_ids)
    if policy.compute_dtype in models.LOW_PRECISION_DTYPES:
        float32_ids |= default_float32_layers(model)
    with warnings.catch_warnings():
        # Keras's optimizers read their learning rate with np.array(variable)
        # in get_config(), which NumPy 2 warns about once per call.
        warnings.filterwarnings(
            "ignore", _NUMPY_COPY_WARNING, category=DeprecationWarning
        )
        if rebuild.rebuilds_from_config(model):
            converted, variables = rebuild.rebuild(
                model, policy, float32_ids, named_ids
            )
        else:
            converted, variables = _clone(model, policy, float32_ids)
        if model.compiled:
            convert_optimizer.compile_copy(
                converted,
                model,
                policy,
                wraps,
                rounding,
                slot_dtype,
                seed,
                variables,
            )
    return converted


_NUMPY_COPY_WARNING = "__array__ implementation doesn't accept a copy keyword"


class _CannotRebuild(Exception):
    """A layer's `from_config(get_config())` failed while cloning."""

    def __init__(self, layer, error):
        super().__init__(str(error))
        self.layer = layer
        self.error = error


def _clone(model, policy, float32_ids):
    """`clone_model` with every floating layer's policy replaced, LoRA and
    trainable flags as the model's (`fine_tuning`): `(copy, [(variable,
    its copy), ...])`."""
    target = keras.DTypePolicy(policy.name)
    float32 = keras.DTypePolicy("float32")
    pairs = []

    def clone_operation(operation):
        try:
            config = operation.get_config()
            if models.is_layer(operation) and models.has_floating_policy(
                operation
            ):
                keep = id(operation) in float32_ids
                config["dtype"] = float32 if keep else target
            clone = operation.__class__.from_config(config)
        except Exception as error:
            raise _CannotRebuild(operation, error) from error
        if models.is_layer(operation):  # keras.ops calls have no weights.
            pairs.append((operation, clone))
        return clone

    # The containers are created under `policy` too, so that compile() sees a
    # "mixed_float16" model and adds loss scaling by itself.
    with policy_scope(policy):
        try:
            converted = keras.models.clone_model(
                model,
                input_tensors=_named_inputs(model),
                clone_function=clone_operation,
                recursive=True,
            )
        except _CannotRebuild as failure:
            layer, error = failure.layer, failure.error
            reason = str(error).strip().splitlines()[0].rstrip(".")
            raise ValueError(
                "kmp.convert() rebuilds every layer from its config "
                f"(layer.get_config()), and rebuilding layer {layer.name!r} "
                f"({type(layer).__name__}) of model {model.name!r} failed: "
                f"{type(error).__name__}: {reason}. Layers that cannot be "
                "rebuilt from their config (Lambda layers, custom layers "
                "without a complete get_config(), subclassed models inside) "
                "are converted by building the model again under the policy "
                "instead: `with kmp.policy_scope(policy): new = "
                "build_model()`, then `new.set_weights(model.get_weights())`."
            ) from error
    fine_tuning.enable_lora_like(pairs, "convert")
    for layer, clone in pairs:
        clone.set_weights(layer.get_weights())
    variables = fine_tuning.variable_pairs(pairs)
    fine_tuning.trainable_like(pairs, variables)
    return converted, variables


def _named_inputs(model):
    """New inputs named like the model's input layers (None if Sequential).

    Left to itself, clone_model names a Functional model's input layers after
    their tensors ('keras_tensor') rather than after the layers.
    """
    if isinstance(model, keras.Sequential):
        return None

    def new_input(tensor):
        return keras.Input(
            batch_shape=tensor.shape,
            dtype=tensor.dtype,
            sparse=tensor.sparse,
            name=tensor._keras_history.operation.name,
        )

    return keras.tree.map_structure(new_input, model.input)


__all__ = ["convert"]
