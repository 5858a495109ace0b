"""`kmp doctor`: what this machine offers for mixed precision, and the policy.

It reports the Keras backend and versions, the GPUs with their compute
capability, the TPUs, and the CPU's bfloat16 and float16 instructions, then
recommends a policy by the rule of `kmp.core.hardware.recommend_policy`
(which decides from plain values, so any machine can be asked about), and,
for when memory rather than speed is the limit, the bytes per parameter of
each way to train and how to get bfloat16 weights that still train.

>>> environment = Environment(
...     "tensorflow", "2.21.0", "3.15.1", "3.11.7", gpus=(), tpus=0,
...     cpu_flags=frozenset({"avx512_bf16"}))
>>> report = format_report(environment).splitlines()
>>> print(next(line for line in report if line.startswith("Recommended")))
Recommended policy: mixed_bfloat16
"""

import dataclasses
import platform
from typing import Optional
from typing import Tuple

import keras

from kmp.core import backend
from kmp.core.hardware import BFLOAT16_CPU_FLAGS
from kmp.core.hardware import CPUINFO_PATH
from kmp.core.hardware import FLOAT16_CPU_FLAGS
from kmp.core.hardware import Gpu
from kmp.core.hardware import count_tpus
from kmp.core.hardware import list_gpus
from kmp.core.hardware import read_cpu_flags
from kmp.core.hardware import recommend_policy
from kmp.core.low_bit import codes as low_bit_codes
from kmp.core.low_bit import quantization


@dataclasses.dataclass(frozen=True)
class Environment:
    """What `kmp doctor` found on this machine.

    Attributes:
        backend: Keras's backend ("tensorflow", "jax", "torch").
        backend_version: That framework's version.
        keras_version: `keras.__version__`.
        python_version: The Python version.
        gpus: The physical GPUs.
        tpus: How many TPU devices the backend sees.
        cpu_flags: The CPU flags read from /proc/cpuinfo, or None when it
            could not be read (not Linux, for one).
    """

    backend: str
    backend_version: str
    keras_version: str
    python_version: str
    gpus: Tuple[Gpu, ...]
    tpus: int
    cpu_flags: Optional[frozenset]


def collect_environment() -> Environment:
    """Looks at this machine: versions, GPUs, TPUs and CPU flags."""
    return Environment(
        backend=backend.name(),
        backend_version=_framework_version(backend.name()),
        keras_version=keras.__version__,
        python_version=platform.python_version(),
        gpus=tuple(list_gpus()),
        tpus=count_tpus(),
        cpu_flags=read_cpu_flags(),
    )


def _framework_version(name: str) -> str:
    module = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}.get(
        name
    )
    if module is None:
        return "unknown"
    import importlib

    return importlib.import_module(module).__version__


_FRAMEWORK_NAMES = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "torch"}


def format_report(environment: Environment) -> str:
    """The text `kmp doctor` prints for `environment`."""
    framework = _FRAMEWORK_NAMES.get(environment.backend, environment.backend)
    lines = [
        f"Keras {environment.keras_version} on the {environment.backend} "
        f"backend ({framework} {environment.backend_version}), Python "
        f"{environment.python_version}",
    ]
    if environment.gpus:
        lines.append(f"GPUs: {len(environment.gpus)}")
        lines.extend(
            f"  GPU {index}: {gpu.describe()}"
            + ("" if gpu.has_tensor_cores else ", no Tensor Cores")
            for index, gpu in enumerate(environment.gpus)
        )
    else:
        lines.append("GPUs: none")
    lines.append(f"TPUs: {environment.tpus or 'none'}")
    if environment.cpu_flags is None:
        lines.append(
            f"CPU bfloat16 instructions: unknown ({CPUINFO_PATH} unreadable)"
        )
    else:
        present = [f for f in BFLOAT16_CPU_FLAGS if f in environment.cpu_flags]
        lines.append(
            "CPU bfloat16 instructions: " + (", ".join(present) or "none")
        )
        present = [f for f in FLOAT16_CPU_FLAGS if f in environment.cpu_flags]
        lines.append(
            "CPU float16 instructions: " + (", ".join(present) or "none")
        )
        if (
            present
            and not environment.gpus
            and environment.backend == ("tensorflow")
        ):
            lines.append(
                "  float16 is fast here only with TensorFlow's op fusion off: "
                "tf.config.optimizer.set_experimental_options("
                "{'remapping': False}) (its fused float16 MatMul kernel is "
                "far slower on CPUs than the plain ops)"
            )
    policy, reason = recommend_policy(
        environment.gpus, environment.tpus, environment.cpu_flags
    )
    lines += [
        "",
        f"Recommended policy: {policy}",
        f"  {reason}",
        f"  kmp.set_global_policy({policy!r})",
        "",
        *memory_advice(),
    ]
    return "\n".join(lines)


_BFLOAT16 = 2  # Bytes of a bfloat16 weight, and of its gradient.
_LOW_BIT_NAMES = {"8bit": "8-bit", "float8": "float8", "4bit": "4-bit"}


def _low_bit_row(slot_dtype: str) -> tuple:
    """The row of bfloat16 weights with `slot_dtype` state: the sizes
    `kmp.core.low_bit` gives its codes and scales."""
    code = low_bit_codes.CODES[slot_dtype]
    per_slot = quantization.bytes_per_element(code)
    size = "half a byte" if code.per_byte == 2 else "a byte"
    return (
        f"bfloat16, {_LOW_BIT_NAMES[slot_dtype]} slots",
        2 * _BFLOAT16 + 2 * per_slot,
        f"stochastic; 2 + 2 gradient + 2 x {per_slot:.3g}: "
        f"slot_dtype={slot_dtype!r}, {size} and a "
        f"{quantization.SCALE_DTYPE} scale per {code.block_size}",
    )


# Bytes per parameter of training with Adam, before activations: weights,
# gradients, the two slots (and Kahan's compensation buffer); quantized
# slots for variables of `min_8bit_size` elements or more (smaller ones
# keep bfloat16 slots).
TRAINING_BYTES_PER_PARAMETER = (
    ("float32", 16, "4 + 4 gradient + 4 + 4 slots"),
    ("mixed_bfloat16 / mixed_float16", 16, "float32 weights and slots"),
    ("mixed + bfloat16 slots", 12, "slot_dtype='bfloat16'"),
    ("bfloat16 + Kahan, bfloat16 slots", 10, "2 + 2 compensation + 2 + 2 + 2"),
    ("bfloat16 + stochastic rounding", 8, "2 + 2 gradient + 2 + 2 slots"),
    *(_low_bit_row(name) for name in _LOW_BIT_NAMES),
)


def _bytes_text(size: float) -> str:
    return f"{size:.2f}".rstrip("0").rstrip(".")


def memory_advice() -> list:
    """Lines for when memory, not speed, limits training (`kmp doctor`),
    the same on every backend.

    >>> print(memory_advice()[-1].split(": ")[0])
      bfloat16 weights that still train
    """
    lines = [
        "If memory, not speed, is the limit (Adam; bytes per parameter "
        "before activations):"
    ]
    lines += [
        f"  {name:34} {_bytes_text(size):>5}  ({what})"
        for name, size, what in TRAINING_BYTES_PER_PARAMETER
    ]
    cheapest = min(TRAINING_BYTES_PER_PARAMETER, key=lambda row: row[1])
    lines += [
        f"  {'any of these, sharded N ways':34} {'/ N':>5}  (JAX's "
        "keras.distribution.ModelParallel: a variable the layout map "
        "shards over N devices keeps 1/N of its weights and state on "
        "each, its slots, codes and scales sharded like it: "
        f"{cheapest[0]}, {_bytes_text(cheapest[1])} / N; kmp.summary shows "
        "the state per device)",
        "  bfloat16 weights that still train: kmp.convert(model, "
        "'bfloat16', rounding='kahan', slot_dtype='bfloat16') "
        "(guides/bfloat16_weights.py); slot_dtype='8bit' for 8-bit state "
        "(guides/eight_bit_state.py)",
    ]
    return lines


__all__ = [
    "TRAINING_BYTES_PER_PARAMETER",
    "memory_advice",
    "Environment",
    "collect_environment",
    "format_report",
]
