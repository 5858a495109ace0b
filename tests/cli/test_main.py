"""Tests for the `kmp` command itself (kmp_cli/__init__.py): fast to start.

`kmp --version` and `kmp --help` import neither kmp nor Keras (nor
TensorFlow); the commands import them when they run.
"""

import importlib.metadata
import os
import subprocess
import sys

import pytest

import kmp
import kmp_cli

# The same on every backend: CI runs it on TensorFlow only.
pytestmark = pytest.mark.anybackend


def _run_python(code):
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


_IMPORTED = (
    "print(sorted({m.split('.')[0] for m in sys.modules} & "
    "{'kmp', 'keras', 'tensorflow', 'numpy'}))"
)


@pytest.mark.parametrize(
    "argv",
    [["--version"], ["--help"], ["bench", "--help"], ["audit", "--help"]],
    ids=["version", "help", "bench_help", "audit_help"],
)
def test_version_and_help_import_neither_kmp_nor_keras(argv):
    code = (
        "import contextlib, io, sys, kmp_cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        f"        kmp_cli.main({argv!r})\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"{_IMPORTED}\n"
    )
    assert _run_python(code).strip() == "[]"


def test_version_is_the_installed_distributions(capsys):
    assert kmp_cli.main(["--version"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == importlib.metadata.version("kmp") == kmp.__version__


def test_no_command_prints_the_help(capsys):
    assert kmp_cli.main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: kmp")
    for command in kmp_cli.COMMANDS:
        assert command in out


def test_an_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as raised:
        kmp_cli.main(["fly"])
    assert raised.value.code == 2
    assert "invalid choice: 'fly'" in capsys.readouterr().err


def test_python_dash_m_kmp_is_the_command():
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    completed = subprocess.run(
        [sys.executable, "-m", "kmp", "--version"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip() == kmp.__version__
