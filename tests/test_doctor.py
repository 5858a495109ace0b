"""Tests for kmp.doctor: hardware facts in, a policy and its reason out."""

import importlib
import logging

import pytest

from kmp.cli import main

doctor = importlib.import_module("kmp.doctor")
Gpu = doctor.Gpu

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
    assert doctor.parse_cpu_flags(text) == expected


def test_read_cpu_flags_from_a_file_and_a_missing_file(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(X86_CPUINFO)
    assert "amx_bf16" in doctor.read_cpu_flags(str(path))
    assert doctor.read_cpu_flags(str(tmp_path / "missing")) is None


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
    chosen, why = doctor.recommend_policy(gpus, tpus, flags)
    assert chosen == policy
    assert reason in why


def test_list_gpus_reads_device_details(monkeypatch):
    devices = ["gpu0", "gpu1"]
    details = {
        "gpu0": {"device_name": "NVIDIA T4", "compute_capability": (7, 5)},
        "gpu1": {},
    }
    tf_config = doctor.tf.config
    monkeypatch.setattr(
        tf_config,
        "list_physical_devices",
        lambda kind: devices if kind == "GPU" else [],
    )
    monkeypatch.setattr(
        tf_config.experimental, "get_device_details", details.__getitem__
    )
    assert doctor.list_gpus() == [
        Gpu("NVIDIA T4", (7, 5)),
        Gpu("GPU 1", None),
    ]


def test_format_report():
    environment = doctor.Environment(
        tensorflow_version="2.21.0",
        keras_version="3.15.1",
        python_version="3.11.7",
        gpus=(PASCAL, AMPERE),
        tpus=0,
        cpu_flags=frozenset({"avx512_bf16"}),
    )
    text = doctor.format_report(environment)
    assert text.startswith("TensorFlow 2.21.0, Keras 3.15.1")
    assert "GPU 0: Tesla P100 (compute capability 6.0), no Tensor Cores" in (
        text
    )
    assert "GPU 1: NVIDIA A100 (compute capability 8.0)\n" in text
    assert "CPU bfloat16 instructions: avx512_bf16" in text
    assert "CPU float16 instructions: none" in text
    assert "Recommended policy: mixed_float16" in text
    assert "kmp.set_global_policy('mixed_float16')" in text


def test_format_report_on_a_cpu_with_float16_instructions():
    environment = doctor.Environment(
        "2.21.0", "3.15.1", "3.11.7", (), 0, frozenset({"avx512_fp16"})
    )
    text = doctor.format_report(environment)
    assert "CPU float16 instructions: avx512_fp16" in text
    assert "{'remapping': False}" in text


def test_format_report_without_cpuinfo_or_gpus():
    environment = doctor.Environment("2", "3", "3.11", (), 0, None)
    text = doctor.format_report(environment)
    assert "GPUs: none" in text
    assert "CPU bfloat16 instructions: unknown" in text
    assert "Recommended policy: float32" in text


@pytest.fixture
def fake_machine(monkeypatch):
    """Replaces the hardware probes; yields a dict to describe the machine."""
    machine = {"gpus": [], "tpus": 0, "flags": frozenset()}
    monkeypatch.setattr(doctor, "list_gpus", lambda: machine["gpus"])
    monkeypatch.setattr(doctor, "count_tpus", lambda: machine["tpus"])
    monkeypatch.setattr(doctor, "read_cpu_flags", lambda: machine["flags"])
    monkeypatch.setattr(doctor, "_float16_checked", False)
    return machine


def test_float16_warning_is_logged_once_per_process(fake_machine, caplog):
    fake_machine["flags"] = frozenset({"amx_bf16"})
    with caplog.at_level(logging.WARNING, logger="kmp"):
        assert doctor.warn_if_float16_is_slow() is True
        assert doctor.warn_if_float16_is_slow() is False
    (record,) = caplog.records
    assert record.name == "kmp"
    assert "'float16') will be slow here" in record.getMessage()
    assert "no GPU" in record.getMessage()
    assert "Use 'mixed_bfloat16' instead" in record.getMessage()
    assert "{'remapping': False}" in record.getMessage()


def test_float16_warning_on_a_cpu_with_float16_instructions(
    fake_machine, caplog
):
    fake_machine["flags"] = frozenset({"avx512_bf16", "avx512_fp16"})
    with caplog.at_level(logging.WARNING, logger="kmp"):
        assert doctor.warn_if_float16_is_slow() is True
    message = caplog.records[0].getMessage()
    assert "this CPU has float16 instructions (avx512_fp16)" in message
    assert "about as fast as bfloat16" in message


def test_float16_warning_names_the_slow_gpu(fake_machine, caplog):
    fake_machine["gpus"] = [PASCAL]
    with caplog.at_level(logging.WARNING, logger="kmp"):
        assert doctor.warn_if_float16_is_slow() is True
    message = caplog.records[0].getMessage()
    assert "Tesla P100 (compute capability 6.0)" in message
    assert "Use 'float32' instead" in message


def test_no_float16_warning_with_a_tensor_core_gpu(fake_machine, caplog):
    fake_machine["gpus"] = [PASCAL, VOLTA]
    with caplog.at_level(logging.WARNING, logger="kmp"):
        assert doctor.warn_if_float16_is_slow() is False
        fake_machine["gpus"] = []  # Only the first call looks.
        assert doctor.warn_if_float16_is_slow() is False
    assert caplog.records == []


def test_doctor_command(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("TensorFlow ")
    assert "\nGPUs: " in out
    assert "\nRecommended policy: " in out
