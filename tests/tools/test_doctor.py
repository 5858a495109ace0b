"""Tests for kmp.tools.doctor: what `kmp doctor` reports for a machine."""

import importlib

import keras
import numpy as np
import pytest

from kmp.core.hardware import Gpu
from kmp.tools import doctor

AMPERE = Gpu("NVIDIA A100", (8, 0))
PASCAL = Gpu("Tesla P100", (6, 0))


def test_format_report():
    environment = doctor.Environment(
        backend="tensorflow",
        backend_version="2.21.0",
        keras_version="3.15.1",
        python_version="3.11.7",
        gpus=(PASCAL, AMPERE),
        tpus=0,
        cpu_flags=frozenset({"avx512_bf16"}),
    )
    text = doctor.format_report(environment)
    assert text.startswith(
        "Keras 3.15.1 on the tensorflow backend (TensorFlow 2.21.0), "
        "Python 3.11.7\n"
    )
    assert "GPU 0: Tesla P100 (compute capability 6.0), no Tensor Cores" in (
        text
    )
    assert "GPU 1: NVIDIA A100 (compute capability 8.0)\n" in text
    assert "CPU bfloat16 instructions: avx512_bf16" in text
    assert "CPU float16 instructions: none" in text
    assert "Recommended policy: mixed_float16" in text
    assert "kmp.set_global_policy('mixed_float16')" in text


def test_format_report_on_other_backends():
    environment = doctor.Environment(
        "jax", "0.7.0", "3.15.1", "3.11.7", (), 0, frozenset()
    )
    assert doctor.format_report(environment).startswith(
        "Keras 3.15.1 on the jax backend (JAX 0.7.0)"
    )


def test_format_report_on_a_cpu_with_float16_instructions():
    environment = doctor.Environment(
        "tensorflow",
        "2.21.0",
        "3.15.1",
        "3.11.7",
        (),
        0,
        frozenset({"avx512_fp16"}),
    )
    text = doctor.format_report(environment)
    assert "CPU float16 instructions: avx512_fp16" in text
    assert "{'remapping': False}" in text


def test_format_report_without_cpuinfo_or_gpus():
    environment = doctor.Environment(
        "tensorflow", "2", "3", "3.11", (), 0, None
    )
    text = doctor.format_report(environment)
    assert "GPUs: none" in text
    assert "CPU bfloat16 instructions: unknown" in text
    assert "Recommended policy: float32" in text


def test_collect_environment_sees_this_machine():
    environment = doctor.collect_environment()
    name = keras.backend.backend()
    assert environment.backend == name
    framework = importlib.import_module(name)
    assert environment.backend_version == framework.__version__
    assert environment.tpus == 0


def _environment(backend):
    return doctor.Environment(
        backend, "x", "3.15.1", "3.11.7", (), 0, frozenset({"avx512_bf16"})
    )


def test_report_says_what_to_do_when_memory_is_the_limit():
    text = doctor.format_report(_environment("tensorflow"))
    memory = text[text.index("If memory, not speed, is the limit") :]
    for name, size, _ in doctor.TRAINING_BYTES_PER_PARAMETER:
        text_size = f"{size:.2f}".rstrip("0").rstrip(".")
        assert f"  {name:34} {text_size:>5}  (" in memory
    assert "any of these, sharded N ways" in memory
    assert "keras.distribution.ModelParallel" in memory
    assert "kmp.convert(model, 'bfloat16', rounding='kahan'" in memory
    assert "needs the TensorFlow backend" not in memory
    # The memory advice comes after the (speed) recommendation.
    assert text.index("Recommended policy") < text.index("If memory")


def test_bytes_per_parameter_fall_with_each_step_to_bfloat16():
    sizes = [size for _, size, _ in doctor.TRAINING_BYTES_PER_PARAMETER]
    assert sizes[:5] == [16, 16, 12, 10, 8]
    # 8-bit and float8: a byte and a float32 scale per 256; 4-bit: half a
    # byte and one per 128.
    assert sizes[5:] == [4 + 2 * (1 + 4 / 256)] * 2 + [4 + 2 * (0.5 + 4 / 128)]


@pytest.mark.parametrize("slot_dtype", ["8bit", "float8", "4bit"])
def test_low_bit_rows_are_the_bytes_the_optimizer_keeps(slot_dtype):
    """Each quantized row is what LowPrecisionOptimizer allocates: the
    bfloat16 weight and its gradient, and Adam's two slots' codes and
    scales for a 256 x 256 kernel, per parameter."""
    import kmp

    (row,) = [
        size
        for _, size, what in doctor.TRAINING_BYTES_PER_PARAMETER
        if f"slot_dtype={slot_dtype!r}" in what
    ]
    with kmp.policy_scope("bfloat16"):
        model = keras.Sequential(
            [keras.Input((256,)), keras.layers.Dense(256, use_bias=False)]
        )
    kernel = model.layers[0].kernel
    optimizer = kmp.LowPrecisionOptimizer(
        keras.optimizers.Adam(), "stochastic", slot_dtype=slot_dtype, seed=0
    )
    optimizer.build([kernel])
    key = kernel.path.replace("/", "_")
    state = [v for v in optimizer.variables if key in v.path]
    assert len(state) == 4  # Two slots, each codes and scales.
    state_bytes = sum(
        np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in state
    )
    weight_and_gradient = 2 * np.dtype(kernel.dtype).itemsize
    assert weight_and_gradient + state_bytes / 256**2 == row


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_memory_advice_is_the_same_on_every_backend(backend):
    text = doctor.format_report(_environment(backend))
    assert "If memory" in text
    assert "\n".join(doctor.memory_advice()) in text
    assert "needs the TensorFlow backend" not in text
