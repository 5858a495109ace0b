"""Tests for kmp.core.hardware: machine facts in, a policy and its reason out.

(Moved from the doctor's tests: `kmp doctor` reports what this module finds.)
"""

import logging

import pytest

from kmp.core import hardware
from kmp.core.hardware import Gpu
from tests.support import backends

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16
bogomips\t: 4000.00

processor\t: 1
flags\t\t: fpu
"""
ARM_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\n"


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            X86_CPUINFO,
            {
                "fpu",
                "vme",
                "sse2",
                "avx2",
                "avx512f",
                "avx512_bf16",
                "amx_tile",
                "amx_bf16",
            },
        ),
        (ARM_CPUINFO, {"fp", "asimd", "bf16", "sve"}),
        ("processor : 0\n", set()),
        ("", set()),
    ],
    ids=["x86", "arm", "no_flags_line", "empty"],
)
def test_parse_cpu_flags(text, expected):
    assert hardware.parse_cpu_flags(text) == expected


def test_read_cpu_flags_from_a_file_and_a_missing_file(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(X86_CPUINFO)
    assert "amx_bf16" in hardware.read_cpu_flags(str(path))
    assert hardware.read_cpu_flags(str(tmp_path / "missing")) is None


AMPERE = Gpu("NVIDIA A100", (8, 0))
VOLTA = Gpu("Tesla V100", (7, 0))
PASCAL = Gpu("Tesla P100", (6, 0))
UNKNOWN = Gpu("GPU 0", None)


@pytest.mark.parametrize(
    "gpus, tpus, flags, policy, reason",
    [
        ([], 8, None, "mixed_bfloat16", "8 TPU device"),
        ([AMPERE], 0, set(), "mixed_float16", "NVIDIA A100"),
        ([VOLTA], 0, set(), "mixed_float16", "compute capability 7.0"),
        ([PASCAL, AMPERE], 0, set(), "mixed_float16", "NVIDIA A100"),
        ([PASCAL], 0, {"avx512_bf16"}, "float32", "no Tensor Cores"),
        ([UNKNOWN], 0, set(), "float32", "compute capability unknown"),
        ([], 0, {"avx512_bf16"}, "mixed_bfloat16", "avx512_bf16"),
        ([], 0, {"amx_bf16", "amx_tile"}, "mixed_bfloat16", "amx_bf16"),
        ([], 0, {"amx_tile"}, "float32", "no bfloat16 instructions"),
        ([], 0, {"avx2"}, "float32", "no bfloat16 instructions"),
        ([], 0, None, "float32", "support is unknown"),
    ],
    ids=[
        "tpu",
        "ampere",
        "volta",
        "any_fast_gpu",
        "pascal",
        "unknown_gpu",
        "cpu_avx512_bf16",
        "cpu_amx",
        "cpu_amx_tile_only",
        "cpu_plain",
        "no_cpuinfo",
    ],
)
def test_recommend_policy(gpus, tpus, flags, policy, reason):
    chosen, why = hardware.recommend_policy(gpus, tpus, flags)
    assert chosen == policy
    assert reason in why


@pytest.mark.tensorflow
def test_list_gpus_reads_device_details(monkeypatch):
    devices = ["gpu0", "gpu1"]
    details = {
        "gpu0": {"device_name": "NVIDIA T4", "compute_capability": (7, 5)},
        "gpu1": {},
    }
    tf_config = pytest.importorskip("tensorflow").config
    monkeypatch.setattr(
        tf_config,
        "list_physical_devices",
        lambda kind: devices if kind == "GPU" else [],
    )
    monkeypatch.setattr(
        tf_config.experimental, "get_device_details", details.__getitem__
    )
    assert hardware.list_gpus() == [
        Gpu("NVIDIA T4", (7, 5)),
        Gpu("GPU 1", None),
    ]


@pytest.mark.jax
def test_list_gpus_reads_jax_devices(monkeypatch):
    import jax

    class Device:
        def __init__(self, platform, kind, capability=None):
            self.platform = platform
            self.device_kind = kind
            if capability is not None:
                self.compute_capability = capability

    devices = [
        Device("cpu", "cpu"),
        Device("gpu", "NVIDIA T4", "7.5"),
        Device("gpu", "GPU 1"),
    ]
    monkeypatch.setattr(jax, "devices", lambda: devices)
    assert hardware.list_gpus() == [
        Gpu("NVIDIA T4", (7, 5)),
        Gpu("GPU 1", None),
    ]


@pytest.mark.torch
def test_list_gpus_reads_torch_cuda_devices(monkeypatch):
    import torch

    names = ["Tesla P100", "NVIDIA A100"]
    capabilities = [(6, 0), (8, 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", names.__getitem__)
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", capabilities.__getitem__
    )
    assert hardware.list_gpus() == [
        Gpu("Tesla P100", (6, 0)),
        Gpu("NVIDIA A100", (8, 0)),
    ]


@pytest.fixture
def fake_machine(monkeypatch):
    """Replaces the hardware probes; yields a dict to describe the machine."""
    machine = {"gpus": [], "tpus": 0, "flags": frozenset()}
    monkeypatch.setattr(hardware, "list_gpus", lambda: machine["gpus"])
    monkeypatch.setattr(hardware, "count_tpus", lambda: machine["tpus"])
    monkeypatch.setattr(hardware, "read_cpu_flags", lambda: machine["flags"])
    monkeypatch.setattr(hardware, "_float16_checked", False)
    return machine


def test_float16_warning_is_logged_once_per_process(fake_machine, caplog):
    fake_machine["flags"] = frozenset({"amx_bf16"})
    with caplog.at_level(logging.WARNING, logger="kmp"):
        assert hardware.warn_if_float16_is_slow() is True
        assert hardware.warn_if_float16_is_slow() is False
    (record,) = caplog.records
    assert record.name == "kmp"
    assert "'float16') will be slow here" in record.getMessage()
    assert "no GPU" in record.getMessage()
    assert "Use 'mixed_bfloat16' instead" in record.getMessage()
    # The fix for TensorFlow's slow fused kernel, on TensorFlow only.
    tensorflow_fix = "{'remapping': False}" in record.getMessage()
    assert tensorflow_fix == backends.TENSORFLOW


@pytest.mark.tensorflow
def test_float16_warning_on_a_cpu_with_float16_instructions(
    fake_machine, caplog
):
    fake_machine["flags"] = frozenset({"avx512_bf16", "avx512_fp16"})
    with caplog.at_level(logging.WARNING, logger="kmp"):
        assert hardware.warn_if_float16_is_slow() is True
    message = caplog.records[0].getMessage()
    assert "this CPU has float16 instructions (avx512_fp16)" in message
    assert "about as fast as bfloat16" in message


def test_float16_warning_names_the_slow_gpu(fake_machine, caplog):
    fake_machine["gpus"] = [PASCAL]
    with caplog.at_level(logging.WARNING, logger="kmp"):
        assert hardware.warn_if_float16_is_slow() is True
    message = caplog.records[0].getMessage()
    assert "Tesla P100 (compute capability 6.0)" in message
    assert "Use 'float32' instead" in message


def test_no_float16_warning_with_a_tensor_core_gpu(fake_machine, caplog):
    fake_machine["gpus"] = [PASCAL, VOLTA]
    with caplog.at_level(logging.WARNING, logger="kmp"):
        assert hardware.warn_if_float16_is_slow() is False
        fake_machine["gpus"] = []  # Only the first call looks.
        assert hardware.warn_if_float16_is_slow() is False
    assert caplog.records == []
