"""The hardware: GPUs, TPUs, CPU instructions, and the policy they suit.

Pure functions of plain values (`parse_cpu_flags`, `recommend_policy`)
decide, so they can be tested with made-up machines; `list_gpus`,
`count_tpus` and `read_cpu_flags` look at this machine through the Keras
backend in use. The policy recommended:

1. a TPU: `"mixed_bfloat16"` (TPUs compute in bfloat16 natively);
2. a GPU of compute capability 7.0 or higher: `"mixed_float16"` (Tensor
   Cores multiply float16 matrices several times faster than float32);
3. no such GPU, but a CPU with AVX512-BF16 or AMX-BF16 instructions:
   `"mixed_bfloat16"` (only when no GPU would run the model instead);
4. otherwise `"float32"`: low precision would only be emulated, and slower.

`warn_if_float16_is_slow()` uses the same rule to warn, once per process,
when float16 is chosen on a machine that would run it slowly.
"""

import dataclasses
import importlib
import logging
import threading
from typing import Iterable
from typing import List
from typing import Optional
from typing import Tuple

from kmp.core import backend

CPUINFO_PATH = "/proc/cpuinfo"
# The x86 flags /proc/cpuinfo shows for bfloat16 instructions.
BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")
FLOAT16_CPU_FLAGS = ("avx512_fp16", "amx_fp16")
# amx_tile is AMX's tile registers; the bfloat16 arithmetic is amx_bf16.
_BFLOAT16_ARITHMETIC_FLAGS = ("avx512_bf16", "amx_bf16")
TENSOR_CORE_CAPABILITY = (7, 0)

logger = logging.getLogger("kmp")


@dataclasses.dataclass(frozen=True)
class Gpu:
    """A GPU as the backend describes it.

    Attributes:
        name: The device's name, such as `"NVIDIA A100-SXM4-40GB"`.
        compute_capability: `(major, minor)`, or None when unknown.
    """

    name: str
    compute_capability: Optional[Tuple[int, int]] = None

    @property
    def has_tensor_cores(self) -> bool:
        """Whether its compute capability is 7.0 or higher."""
        return (
            self.compute_capability is not None
            and tuple(self.compute_capability) >= TENSOR_CORE_CAPABILITY
        )

    def describe(self) -> str:
        if self.compute_capability is None:
            return f"{self.name} (compute capability unknown)"
        major, minor = self.compute_capability
        return f"{self.name} (compute capability {major}.{minor})"


def parse_cpu_flags(cpuinfo: str) -> frozenset:
    """Returns the CPU flags listed in the text of /proc/cpuinfo.

    The flags of the first processor are read (the "flags" line on x86,
    "Features" on ARM).

    Args:
        cpuinfo: The contents of /proc/cpuinfo.

    Returns:
        The flags, lower-case; empty if no such line is found.

    Example:

    >>> sorted(parse_cpu_flags("processor : 0\\nflags : fpu avx512_bf16\\n"))
    ['avx512_bf16', 'fpu']
    """
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.lower().split())
    return frozenset()


def read_cpu_flags(path: str = CPUINFO_PATH) -> Optional[frozenset]:
    """Reads the CPU flags from `path`; None when the file cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return parse_cpu_flags(file.read())
    except OSError:
        return None


def list_gpus() -> List[Gpu]:
    """The physical GPUs the Keras backend sees, with compute capability."""
    if backend.is_tensorflow():
        return _tensorflow_gpus(backend.tensorflow())
    if backend.is_jax():
        jax = importlib.import_module("jax")
        gpus = []
        for device in jax.devices():
            if device.platform != "gpu":
                continue
            capability = getattr(device, "compute_capability", None)
            if isinstance(capability, str) and "." in capability:
                major, minor = capability.split(".")[:2]
                capability = (int(major), int(minor))
            gpus.append(Gpu(device.device_kind, capability or None))
        return gpus
    if backend.is_torch():
        torch = importlib.import_module("torch")
        if not torch.cuda.is_available():
            return []
        return [
            Gpu(
                torch.cuda.get_device_name(index),
                tuple(torch.cuda.get_device_capability(index)),
            )
            for index in range(torch.cuda.device_count())
        ]
    return []


def _tensorflow_gpus(tf) -> List[Gpu]:
    gpus = []
    for index, device in enumerate(tf.config.list_physical_devices("GPU")):
        try:
            details = tf.config.experimental.get_device_details(device)
        except (ValueError, RuntimeError):
            details = {}
        capability = details.get("compute_capability")
        gpus.append(
            Gpu(
                name=details.get("device_name", f"GPU {index}"),
                compute_capability=(
                    None if capability is None else tuple(capability)
                ),
            )
        )
    return gpus


def count_tpus() -> int:
    """How many TPU devices the backend sees (without connecting to one)."""
    if backend.is_tensorflow():
        tf = backend.tensorflow()
        return len(tf.config.list_physical_devices("TPU"))
    if backend.is_jax():
        jax = importlib.import_module("jax")
        return sum(device.platform == "tpu" for device in jax.devices())
    return 0


def recommend_policy(
    gpus: Iterable[Gpu], tpus: int, cpu_flags: Optional[Iterable[str]]
) -> Tuple[str, str]:
    """Chooses a policy for this hardware; see the module docstring.

    Args:
        gpus: The GPUs (`Gpu` values).
        tpus: How many TPUs there are.
        cpu_flags: The CPU's flags, or None if unknown.

    Returns:
        `(policy name, reason)`.

    Example:

    >>> recommend_policy([Gpu("T4", (7, 5))], 0, None)[0]
    'mixed_float16'
    >>> recommend_policy([], 0, {"avx512_bf16"})[0]
    'mixed_bfloat16'
    >>> recommend_policy([Gpu("P100", (6, 0))], 0, {"avx512_bf16"})[0]
    'float32'
    """
    gpus = list(gpus)
    flags = frozenset(cpu_flags or ())
    if tpus:
        return (
            "mixed_bfloat16",
            f"{tpus} TPU device(s): TPUs compute in bfloat16 natively, and "
            "bfloat16 needs no loss scaling.",
        )
    fast = [gpu for gpu in gpus if gpu.has_tensor_cores]
    if fast:
        return (
            "mixed_float16",
            f"{fast[0].describe()} has Tensor Cores (compute capability 7.0 "
            "or higher), which multiply float16 matrices several times "
            "faster than float32. Train with a LossScaleOptimizer (added by "
            "model.compile under this policy).",
        )
    if gpus:
        names = ", ".join(gpu.describe() for gpu in gpus)
        return (
            "float32",
            f"The GPU(s) ({names}) have no Tensor Cores (compute capability "
            "below 7.0): float16 would save memory but not time.",
        )
    bf16 = sorted(flags.intersection(_BFLOAT16_ARITHMETIC_FLAGS))
    if bf16:
        return (
            "mixed_bfloat16",
            f"No GPU; the CPU has bfloat16 instructions ({', '.join(bf16)}), "
            "which the CPU backends use for matrix multiplications and "
            "convolutions.",
        )
    if cpu_flags is None:
        cpu = "the CPU's bfloat16 support is unknown"
    else:
        cpu = "the CPU has no bfloat16 instructions (avx512_bf16, amx_bf16)"
    return (
        "float32",
        f"No GPU or TPU, and {cpu}: low precision would be emulated, "
        "slower than float32.",
    )


# --- The warning set_global_policy gives --------------------------------------

_warning_lock = threading.Lock()
_float16_checked = False


def _cpu_float16_advice(cpu_flags) -> str:
    """What a CPU user who keeps float16 should know (on TensorFlow)."""
    if not backend.is_tensorflow():
        return ""
    fix = (
        "TensorFlow's fused float16 MatMul + BiasAdd kernel is about 1000x "
        "slower on CPUs than the plain ops; turn that fusion off with "
        "tf.config.optimizer.set_experimental_options({'remapping': False})"
    )
    native = sorted(set(FLOAT16_CPU_FLAGS) & set(cpu_flags))
    if native:
        return (
            f" If you keep float16: this CPU has float16 instructions "
            f"({', '.join(native)}), but {fix}; then float16 runs about as "
            "fast as bfloat16 here."
        )
    return f" If you keep float16 anyway: {fix}."


def _float16_slow_message(gpus, tpus, cpu_flags) -> Optional[str]:
    """The warning for `"mixed_float16"` on this hardware, or None if fast."""
    if any(gpu.has_tensor_cores for gpu in gpus):
        return None
    if gpus:
        found = "the GPU(s) " + ", ".join(gpu.describe() for gpu in gpus)
    else:
        found = "no GPU"
    policy, reason = recommend_policy(gpus, tpus, cpu_flags)
    return (
        "Computing in float16 (policies 'mixed_float16', 'float16') will be "
        "slow here: float16 "
        "is fast on GPUs of compute capability 7.0 or higher, and this "
        f"machine has {found}. "
        f"Use {policy!r} instead: {reason}"
        + ("" if gpus else _cpu_float16_advice(cpu_flags))
    )


def warn_if_float16_is_slow() -> bool:
    """Logs a warning, once per process, if float16 would run slowly here.

    Meant for `set_global_policy("mixed_float16")`: when no GPU of compute
    capability 7.0 or higher is present, it logs to the `"kmp"` logger what
    to use instead. Only the first call looks at the hardware; later calls
    do nothing.

    Returns:
        True if this call logged the warning.

    Example:

    >>> warn_if_float16_is_slow() in (True, False)
    True
    """
    global _float16_checked
    with _warning_lock:
        if _float16_checked:
            return False
        _float16_checked = True
    message = _float16_slow_message(list_gpus(), count_tpus(), read_cpu_flags())
    if message is None:
        return False
    logger.warning(message)
    return True
