"""Tests for benchmarks/gpu/: the GPU runner and its wheelhouse, on a CPU.

The runner runs in a subprocess on this environment's backend (JAX or
torch) with `--device cpu --tiny`, kmp taken from this checkout instead
of a wheelhouse; the wheelhouse install is checked on kmp's own wheel,
built here offline and installed with `--no-index` into a folder. The
ratios and goals are checked on made-up results. Nothing is timed.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import keras
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = _load("run")
prepare = _load("prepare_wheelhouse")


# --- The runner, end to end ---------------------------------------------------


@pytest.mark.jax
@pytest.mark.torch
def test_runner_runs_on_the_cpu_with_a_tiny_configuration(tmp_path):
    backend = keras.backend.backend()
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    completed = subprocess.run(
        [
            sys.executable,
            str(GPU / "run.py"),
            "--device",
            "cpu",
            "--tiny",
            "--backends",
            backend,
            "--models",
            "mlp",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=environment,
        timeout=900,
    )
    assert completed.returncode == 0, (
        completed.stdout[-3000:] + (completed.stderr[-3000:])
    )
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["machine"]["device"] == "cpu"
    assert summary["machine"][backend]["platform"] == "cpu"
    run_document = summary["runs"][f"{backend}-mlp"]
    implementations = {r["implementation"] for r in run_document["results"]}
    # kmp bench's --low-precision: bfloat16 weights, 16-bit and 8-bit state.
    expected = {"kmp", "native", "unscaled", "state16", "state8"}
    if backend == "torch":  # PyTorch AMP's float16 (GradScaler): GPU only.
        expected |= {"torch"}
    assert implementations == expected
    loops = [r["loop"] for r in summary["ratios"]]
    assert loops == ["custom", "fit"]
    custom = summary["ratios"][0]
    for key in (
        "bf16_speedup_kmp",
        "overhead_kmp",
        "overhead_keras",
        "state8_speedup",
        "state8_bytes_vs_float32",
    ):
        assert custom[key] is not None
    assert custom["overhead_grad_scaler"] is None  # Needs a GPU.
    assert (custom["bf16_speedup_torch"] is not None) == (backend == "torch")
    goals = {g["goal"] for g in summary["goals"]}
    assert "kmp's loss-scaling overhead <= 2%" in goals
    text = (tmp_path / "results.md").read_text()
    assert f"| {backend} | mlp | custom |" in text
    assert "16-bit and 8-bit optimizer state" in text
    # Every row's float32 at full precision (never a TF32 baseline).
    assert {r["float32_matmuls"] for r in run_document["results"]} == {
        "float32"
    }
    assert "convolutions (TF32 off where 'float32'): float32." in text
    assert (tmp_path / f"{backend}-mlp.log").read_text()


# --- The wheelhouse -----------------------------------------------------------


def test_kmp_installs_from_a_wheelhouse_without_an_index(tmp_path):
    pytest.importorskip("wheel", reason="builds kmp's wheel offline")
    wheelhouse = tmp_path / "wheelhouse"
    artefacts = [ROOT / "build", ROOT / "kmp.egg-info"]
    before = [path.exists() for path in artefacts]
    wheel = prepare.build_kmp_wheel(wheelhouse)
    assert wheel.name.startswith("kmp-") and wheel.suffix == ".whl"
    # Built from a copy: the checkout is left as it was.
    assert [path.exists() for path in artefacts] == before
    target = tmp_path / "site"
    pinned = run.install(wheelhouse, tmp_path, target=target, deps=False)
    assert (target / "kmp" / "__init__.py").exists()
    assert (target / "kmp_cli" / "bench.py").exists()
    assert (target / "kmp" / "tools" / "bench" / "torch.py").exists()
    # What the machine came with is pinned, numpy at least.
    constraints = (tmp_path / "constraints.txt").read_text()
    assert f"numpy=={pinned['numpy']}" in constraints


def test_install_command_never_reaches_an_index():
    command = run.install_command("wh", "c.txt")
    assert command[-1] == "kmp"
    for flag in ("--no-index", "--find-links", "-c"):
        assert flag in command


def test_download_command_targets_the_gpu_machine():
    command = prepare.download_command(
        "wh", ["keras==3.15.1"], "3.12", prepare.DEFAULT_PLATFORMS
    )
    assert "--only-binary=:all:" in command
    assert command[command.index("--python-version") + 1] == "3.12"
    assert "cp312" in command
    assert "manylinux2014_x86_64" in command
    assert command[-1] == "keras==3.15.1"
    requirements = command[command.index("-d") + 2 :]
    assert requirements == ["keras==3.15.1"]  # Never JAX or torch.


# --- Ratios and goals, on made-up results -------------------------------------


def _result(policy, loop, implementation, **values):
    row = {
        "policy": policy,
        "loop": loop,
        "implementation": implementation,
        "speedup_vs_float32": None,
        "loss_scaling_overhead": None,
        "kmp_over_torch": None,
        "peak_memory_mb": None,
        "median_ms": 10.0,
    }
    row.update(values)
    return row


def _torch_transformer():
    return [
        _result("float32", "custom", "kmp", peak_memory_mb=100.0),
        _result("mixed_bfloat16", "custom", "kmp", speedup_vs_float32=1.8),
        _result(
            "mixed_float16",
            "custom",
            "kmp",
            speedup_vs_float32=1.9,
            loss_scaling_overhead=0.015,
        ),
        _result(
            "mixed_float16", "custom", "native", loss_scaling_overhead=0.05
        ),
        _result(
            "mixed_bfloat16",
            "custom",
            "torch",
            speedup_vs_float32=2.1,
            kmp_over_torch=1.1,
        ),
        _result(
            "mixed_float16",
            "custom",
            "torch",
            speedup_vs_float32=2.0,
            loss_scaling_overhead=0.01,
        ),
    ]


def test_ratios_read_one_run():
    (row,) = run.ratios("torch", "transformer", _torch_transformer())
    assert row["bf16_speedup_kmp"] == 1.8
    assert row["bf16_speedup_torch"] == 2.1
    assert row["overhead_kmp"] == 0.015
    assert row["overhead_keras"] == 0.05
    assert row["overhead_grad_scaler"] == 0.01
    assert row["kmp_over_torch_bf16"] == 1.1
    assert row["peak_mb_float32"] == 100.0
    assert row["loop"] == "custom"


def test_goals_compare_with_grad_scaler_and_pytorch_amp():
    rows = run.ratios("torch", "transformer", _torch_transformer())
    rows += run.ratios(
        "jax",
        "transformer",
        [
            _result("mixed_bfloat16", "custom", "kmp", speedup_vs_float32=1.95),
            _result(
                "mixed_float16",
                "custom",
                "kmp",
                loss_scaling_overhead=0.005,
            ),
        ],
    )
    checks = {(c["goal"], c["where"]): c for c in run.goals(rows)}
    overhead = checks[
        ("kmp's loss-scaling overhead <= 2%", "torch, transformer, custom")
    ]
    assert overhead["met"] is True
    scaler = checks[
        (
            "kmp's overhead <= GradScaler's (same model)",
            "torch, transformer, custom",
        )
    ]
    assert (scaler["measured"], scaler["target"], scaler["met"]) == (
        0.015,
        0.01,
        False,
    )
    jax_scaler = checks[
        (
            "kmp's overhead <= GradScaler's (same model)",
            "jax, transformer, custom",
        )
    ]
    assert jax_scaler["met"] is True
    bf16 = checks[
        (
            "kmp's bf16 speed-up >= PyTorch AMP's - 10%",
            "torch, transformer, custom",
        )
    ]
    assert bf16["target"] == pytest.approx(2.1 * 0.9)
    assert bf16["met"] is False  # 1.8 < 1.89
    text = run.markdown(rows, run.goals(rows), ["header"])
    assert "| kmp's bf16 speed-up >= PyTorch AMP's - 10% |" in text
    assert "| torch | transformer | custom |" in text


def test_jax_transformer_on_a_cpu_runs_without_float16():
    assert run.policies_for("jax", "transformer", "cpu") == [
        "float32",
        "mixed_bfloat16",
    ]
    assert run.policies_for("jax", "transformer", "gpu") == list(run.POLICIES)
    assert run.policies_for("torch", "transformer", "cpu") == list(run.POLICIES)


# --- --quick ---------------------------------------------------------------


@pytest.mark.jax  # The runner's logic; one backend suffices (CI's stage 3a).
def test_quick_runs_each_bench_twice_and_says_how_far_they_agree(tmp_path):
    """On JAX, tiny, custom loop only: two kmp bench runs back to back,
    written as they finish."""
    backend = keras.backend.backend()
    completed = subprocess.run(
        [
            sys.executable,
            str(GPU / "run.py"),
            "--quick",
            "--device",
            "cpu",
            "--tiny",
            "--backends",
            backend,
            "--models",
            "mlp",
            "--policies",
            "float32,mixed_float16",
            "--loops",
            "custom",
            "--deadline",
            "600",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=900,
    )
    assert completed.returncode == 0, (
        completed.stdout[-3000:] + completed.stderr[-3000:]
    )
    assert "Plan: 2 kmp bench runs" in completed.stdout
    summary = json.loads((tmp_path / "results.json").read_text())
    assert list(summary["runs"]) == [f"{backend}-mlp-1", f"{backend}-mlp-2"]
    assert summary["skipped"] == []
    for name in summary["runs"]:
        document = json.loads((tmp_path / f"{name}.json").read_text())
        assert {r["steps"] for r in document["results"]} == {100}
        assert "--memory" not in (tmp_path / f"{name}.log").read_text()
    (first,) = summary["ratios"]
    (second,) = summary["second_run_ratios"]
    assert first["loop"] == second["loop"] == "custom"
    low, high = first["overhead_kmp_ci"]
    assert low <= first["overhead_kmp"] <= high
    pairs = {p["ratio"]: p for p in summary["agreement"]}
    assert {"fp16_speedup_kmp", "overhead_kmp", "overhead_keras"} <= set(pairs)
    pair = pairs["fp16_speedup_kmp"]
    assert pair["relative_difference"] == pytest.approx(
        pair["second"] / pair["first"] - 1
    )
    assert "## Two back-to-back runs" in (tmp_path / "results.md").read_text()


def test_quick_leaves_out_what_does_not_fit(tmp_path):
    backend = keras.backend.backend()
    code = run.main(
        [
            "--quick",
            "--device",
            "cpu",
            "--tiny",
            "--backends",
            backend,
            "--deadline",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 1
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["runs"] == {}
    assert summary["skipped"] == [
        f"{backend}-{model}-{index}"
        for model in run.QUICK_MODELS
        for index in (1, 2)
    ]
    assert "Left out to end in time" in (tmp_path / "results.md").read_text()


def test_plan_puts_the_transformer_and_the_mlp_first():
    assert run.MODELS[:2] == run.QUICK_MODELS == ("transformer", "mlp")
    assert run.plan(["jax", "torch"], ["transformer"], 2) == [
        ("jax", "transformer", "jax-transformer-1"),
        ("jax", "transformer", "jax-transformer-2"),
        ("torch", "transformer", "torch-transformer-1"),
        ("torch", "transformer", "torch-transformer-2"),
    ]
