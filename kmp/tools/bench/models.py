"""The models `kmp bench` trains, their sizes and their data.

* `digits` (the default): scikit-learn's bundled 8x8 digits, 75/25 split,
  through Dense -> Dense -> Dense logits; 1024 units (2048 at `large`, on
  a GPU) and batch 256 make the matrix products large enough for 16-bit
  compute to matter on a CPU, and small enough that the fewest timed steps
  of every configuration fit in about two minutes on a 2-core CPU.
* `mlp`, `cnn`, `transformer`: generated data whose labels a fixed rule
  of the inputs gives, drawn so that the classes are learnable within a
  run (so that loss and accuracy mean something), in three sizes: `large`,
  sized for a GPU (compute-bound steps of several milliseconds), `small`,
  for a CPU, and `tiny`, for tests. `auto` is `large` with a GPU, else
  `small`.

Every model trains with Adam at `ModelSpec.learning_rate`: 1e-3, lower for
wide layers (`learning_rate`), where 1e-3 makes training diverge.

Every model ends in a float32 softmax (`Activation("softmax",
dtype="float32")`), as mixed precision wants, and is built under the policy
it is given with seeded initialisers: every configuration of a run starts
from the same weights. `width` is the hidden units (digits, mlp), the first
convolution's filters (cnn) or the model width (transformer).

>>> spec = model_spec("mlp", "tiny")
>>> spec.name, spec.width, spec.batch_size
('mlp', 16, 16)
>>> build_model(spec, "mixed_bfloat16").output.dtype
'float32'
"""

import dataclasses
from typing import Dict
from typing import Optional

import keras
import numpy as np

from kmp.core.policy import policy_scope

MODELS = ("digits", "mlp", "cnn", "transformer")
SIZES = ("auto", "large", "small", "tiny")
CLASSES = 10
_SEED = 0

# Per model and size: width, batch size and the model's other dimensions.
_SIZES = {
    "digits": {
        "large": {"width": 2048, "batch_size": 256},
        "small": {"width": 1024, "batch_size": 256},
        "tiny": {"width": 8, "batch_size": 16},
    },
    "mlp": {
        "large": {"width": 8192, "batch_size": 1024, "inputs": 1024},
        "small": {"width": 1024, "batch_size": 256, "inputs": 784},
        "tiny": {"width": 16, "batch_size": 16, "inputs": 32},
    },
    "cnn": {
        "large": {"width": 64, "batch_size": 128, "image": 64},
        "small": {"width": 32, "batch_size": 32, "image": 32},
        "tiny": {"width": 4, "batch_size": 8, "image": 8},
    },
    "transformer": {
        "large": {
            "width": 512,
            "batch_size": 64,
            "length": 256,
            "heads": 8,
            "blocks": 4,
            "vocabulary": 8192,
        },
        "small": {
            "width": 128,
            "batch_size": 32,
            "length": 64,
            "heads": 4,
            "blocks": 2,
            "vocabulary": 1000,
        },
        "tiny": {
            "width": 16,
            "batch_size": 8,
            "length": 8,
            "heads": 2,
            "blocks": 1,
            "vocabulary": 50,
        },
    },
}
# Generated data sets: this many batches to train on, a quarter to test.
_GENERATED_BATCHES = 16
# Learning rates: this over the width, at most 1e-3 (`learning_rate`).
_MLP_LR_WIDTH = 0.08192
_TRANSFORMER_LR_WIDTH = 0.1
# How far each class's inputs are pushed its own way (`load_data`).
_MLP_MARGIN = 4.0
_CNN_COLOUR = 0.7
_MARKERS_PER_CLASS = 8
_MARKER_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model, at which size: what `build_model` and `load_data` need.

    Attributes:
        name: One of `MODELS`.
        size: `"large"`, `"small"` or `"tiny"` (`"auto"` resolved).
        width: Hidden units, filters or model width (see the module).
        batch_size: Examples per training step.
        dimensions: The model's other dimensions (inputs, image, length...).
        learning_rate: Adam's learning rate (`learning_rate`).
    """

    name: str
    size: str
    width: int
    batch_size: int
    dimensions: Dict[str, int] = dataclasses.field(default_factory=dict)
    learning_rate: float = 1e-3


def learning_rate(name: str, width: int) -> float:
    """Adam's learning rate for model `name` at `width`.

    Adam first moves every weight by about its learning rate, all in the
    direction that lowers the loss, so a layer's outputs move by about the
    learning rate times its fan-in: 1e-3 on the 8192-unit MLP moves them by
    several times their size at every step, and training diverges. The
    MLP and the transformer scale it down with their width (at most 1e-3);
    the digits and the CNN (3x3 convolutions: small fan-ins) keep 1e-3.

    >>> learning_rate("mlp", 8192)
    1e-05
    >>> learning_rate("transformer", 16)
    0.001
    """
    scale = {"mlp": _MLP_LR_WIDTH, "transformer": _TRANSFORMER_LR_WIDTH}
    if name not in scale:
        return 1e-3
    return float(min(1e-3, scale[name] / width))


def model_spec(
    name: str,
    size: str = "auto",
    width: Optional[int] = None,
    batch_size: Optional[int] = None,
    gpu: bool = False,
) -> ModelSpec:
    """The `ModelSpec` of `name` at `size`, `width` and `batch_size` (None:
    the size's own). `size="auto"` is `"large"` when `gpu`, else `"small"`.

    Raises:
        ValueError: an unknown model or size.
    """
    if name not in MODELS:
        raise ValueError(
            f"'model' must be one of {', '.join(MODELS)}. Received: "
            f"model={name!r}"
        )
    if size not in SIZES:
        raise ValueError(
            f"'size' must be one of {', '.join(SIZES)}. Received: size={size!r}"
        )
    if size == "auto":
        size = "large" if gpu else "small"
    dimensions = dict(_SIZES[name][size])
    width = dimensions.pop("width") if width is None else width
    default_batch = dimensions.pop("batch_size")
    batch_size = default_batch if batch_size is None else batch_size
    return ModelSpec(
        name,
        size,
        width,
        batch_size,
        dimensions,
        learning_rate(name, width),
    )


def describe(spec: ModelSpec) -> str:
    """One line: the model and its size, for tables and progress."""
    d = spec.dimensions
    if spec.name == "digits":
        shape = f"64-{spec.width}-{spec.width}-10 MLP on the digits"
    elif spec.name == "mlp":
        shape = f"{d['inputs']}-{spec.width}-{spec.width}-10 MLP"
    elif spec.name == "cnn":
        shape = (
            f"4-convolution CNN, {spec.width}-{2 * spec.width} filters, "
            f"{d['image']}x{d['image']} images"
        )
    else:
        shape = (
            f"{d['blocks']}-block transformer, width {spec.width}, "
            f"{d['heads']} heads, {d['length']} tokens"
        )
    size = "" if spec.name == "digits" else f" ({spec.size})"
    return f"{spec.name}{size}: {shape}, batch {spec.batch_size}"


# --- Models -------------------------------------------------------------------


def _initializer(seed):
    return keras.initializers.GlorotUniform(seed=seed)


def _dense(width, seed, activation=None):
    return keras.layers.Dense(
        width, activation=activation, kernel_initializer=_initializer(seed)
    )


def build_model(spec: ModelSpec, policy: str) -> keras.Model:
    """A fresh model of `spec` under `policy`, from the same weights every
    time (seeded initialisers; the global random state is left alone)."""
    with policy_scope(policy):
        inputs, hidden = _body(spec)
        logits = _dense(CLASSES, 3)(hidden)
        # The softmax and the model's output stay float32 under every policy.
        outputs = keras.layers.Activation("softmax", dtype="float32")(logits)
        return keras.Model(inputs, outputs, name=f"{spec.name}_{policy}")


def _body(spec):
    d = spec.dimensions
    if spec.name in ("digits", "mlp"):
        inputs = keras.Input((d.get("inputs", 64),))
        hidden = _dense(spec.width, 1, "relu")(inputs)
        return inputs, _dense(spec.width, 2, "relu")(hidden)
    if spec.name == "cnn":
        inputs = keras.Input((d["image"], d["image"], 3))
        x = inputs
        for index, filters in enumerate((1, 1, 2, 2)):
            x = keras.layers.Conv2D(
                filters * spec.width,
                3,
                padding="same",
                activation="relu",
                kernel_initializer=_initializer(index + 1),
            )(x)
            if index == 1:
                x = keras.layers.MaxPooling2D()(x)
        return inputs, keras.layers.GlobalAveragePooling2D()(x)
    inputs = keras.Input((d["length"],), dtype="int32")
    x = keras.layers.Embedding(
        d["vocabulary"],
        spec.width,
        embeddings_initializer=keras.initializers.RandomNormal(seed=1),
    )(inputs)
    for block in range(d["blocks"]):
        seed = 10 * (block + 2)
        attention = keras.layers.MultiHeadAttention(
            d["heads"],
            spec.width // d["heads"],
            kernel_initializer=_initializer(seed),
        )(x, x)
        x = keras.layers.LayerNormalization()(x + attention)
        hidden = _dense(4 * spec.width, seed + 1, "relu")(x)
        x = keras.layers.LayerNormalization()(
            x + _dense(spec.width, seed + 2)(hidden)
        )
    return inputs, keras.layers.GlobalAveragePooling1D()(x)


# --- Data ---------------------------------------------------------------------


def load_data(spec: ModelSpec):
    """`(x_train, x_test, y_train, y_test)` as NumPy arrays for `spec`.

    The digits come from scikit-learn (`ImportError` naming `kmp[bench]`
    without it); the other models' data are generated with a fixed seed.
    Each example is drawn for a class, pushed that class's way, and its
    label is then what a fixed rule of the inputs says (the drawn class,
    but for a few close calls):

    * mlp: inputs from a standard normal plus `_MLP_MARGIN` times the
      class's direction (fixed random unit vectors); label: the direction
      the input lies furthest along (a fixed linear teacher);
    * cnn: images of standard normal noise plus the class's colour (fixed,
      spread over the colour sphere, `_CNN_COLOUR` long); label: the
      colour the image's mean colour lies furthest along;
    * transformer: token ids, a quarter of them drawn from the class's
      marker tokens (`_MARKERS_PER_CLASS` fixed ids per class, fewer in
      a small vocabulary), the rest
      uniformly; label: the class whose markers occur most often (the
      model has no positions: the label depends on the tokens only).
    """
    if spec.name == "digits":
        return _digits()
    rng = np.random.default_rng(_SEED)
    count = _GENERATED_BATCHES * spec.batch_size
    count += count // 4
    drawn = rng.integers(0, CLASSES, count)
    d = spec.dimensions
    if spec.name == "mlp":
        directions = rng.standard_normal((CLASSES, d["inputs"]))
        directions /= np.linalg.norm(directions, axis=1, keepdims=True)
        x = rng.standard_normal((count, d["inputs"]))
        x += _MLP_MARGIN * directions[drawn]
        y = np.argmax(x @ directions.T, 1)
    elif spec.name == "cnn":
        colours = _sphere(CLASSES)
        shape = (count, d["image"], d["image"], 3)
        x = rng.standard_normal(shape)
        x += _CNN_COLOUR * colours[drawn][:, None, None, :]
        y = np.argmax(x.mean(axis=(1, 2)) @ colours.T, 1)
    else:
        vocabulary = d["vocabulary"]
        per_class = max(1, min(_MARKERS_PER_CLASS, vocabulary // 20))
        markers = rng.choice(vocabulary, (CLASSES, per_class), replace=False)
        x = rng.integers(0, vocabulary, (count, d["length"]))
        marked = rng.random((count, d["length"])) < _MARKER_SHARE
        picks = rng.integers(0, per_class, (count, d["length"]))
        x = np.where(marked, markers[drawn[:, None], picks], x)
        counts = np.stack(
            [np.isin(x, markers[c]).sum(1) for c in range(CLASSES)]
        )
        y = np.argmax(counts, 0)
    split = _GENERATED_BATCHES * spec.batch_size
    x = x.astype("int32" if spec.name == "transformer" else "float32")
    y = y.astype("int32")
    return x[:split], x[split:], y[:split], y[split:]


def _sphere(count):
    """`count` unit vectors spread evenly over the sphere (Fibonacci)."""
    index = np.arange(count) + 0.5
    z = 1 - 2 * index / count
    angle = np.pi * (1 + 5**0.5) * index
    radius = np.sqrt(1 - z**2)
    return np.stack([radius * np.cos(angle), radius * np.sin(angle), z], 1)


def _digits():
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ImportError(
            "The digits model needs scikit-learn for its data set: "
            "pip install 'kmp[bench]' (or choose another model: mlp, cnn, "
            "transformer)."
        ) from None
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")  # Pixel values are 0..16.
    y = digits.target.astype("int32")
    return train_test_split(
        x, y, test_size=0.25, random_state=_SEED, stratify=y
    )


class Batches:
    """Training batches, made once on the device; step `i` trains on batch
    `i % count`.

    Shuffled passes over the training set, one after another (seeded), cut
    into batches; at most `max_batches`, and at most `max_bytes` of them,
    are kept (the digits: 500 batches of 256). `x`, `y`: one backend tensor
    per batch, so that a step takes its batch without an op; `x_numpy`,
    `y_numpy`: the same, stacked.
    """

    def __init__(self, x, y, batch_size, max_batches=512, max_bytes=32 * 2**20):
        per_batch = batch_size * (x[0].nbytes + y[0].nbytes)
        self.count = max(1, min(max_batches, max_bytes // per_batch))
        rng = np.random.default_rng(_SEED)
        needed = self.count * batch_size
        passes = -(-needed // len(x))
        order = np.concatenate([rng.permutation(len(x)) for _ in range(passes)])
        order = order[:needed].reshape(self.count, batch_size)
        self.x_numpy, self.y_numpy = x[order], y[order]
        convert = keras.ops.convert_to_tensor
        self.x = [convert(batch) for batch in self.x_numpy]
        self.y = [convert(batch) for batch in self.y_numpy]

    def get(self, step):
        """`(x, y)` of the (0-based) `step`."""
        index = step % self.count
        return self.x[index], self.y[index]


__all__ = [
    "MODELS",
    "SIZES",
    "Batches",
    "ModelSpec",
    "build_model",
    "describe",
    "learning_rate",
    "load_data",
    "model_spec",
]
