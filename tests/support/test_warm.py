"""tests.support.warm: a script forked from the warm interpreter runs as a
fresh `python script.py` would, and one that cannot falls back to a fresh
interpreter."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.support import backends
from tests.support import warm

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys, tempfile
    atexit.register(lambda: print("atexit ran"))
    import helper  # next to the script: sys.path[0]
    import on_pythonpath
    print("argv", sys.argv)
    print("cwd", os.getcwd())
    print("variable", os.environ["A_SCRIPT_VARIABLE"])
    print("temporary", tempfile.gettempdir())
    print("kmp imported", "kmp" in sys.modules)
    print("bytecode", not sys.dont_write_bytecode)
    print("stdin", sys.stdin.read())
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "raise":
        raise ValueError("the script's own error")
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture
def script(tmp_path):
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "helper.py").write_text("")
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "on_pythonpath.py").write_text("")
    (tmp_path / "work").mkdir()
    (tmp_path / "temporary").mkdir()
    path = folder / "script.py"
    path.write_text(SCRIPT)
    environment = dict(
        os.environ,
        PYTHONPATH=str(tmp_path / "library"),
        PYTHONDONTWRITEBYTECODE="1",
        TMPDIR=str(tmp_path / "temporary"),
        KMP_GUIDE_SMALL="1",  # Read when a guide runs, not on import.
    )
    return path, environment, tmp_path / "work"


@pytest.mark.anybackend
@pytest.mark.parametrize("argument", ["0", "3", "raise"])
def test_a_forked_script_runs_as_a_fresh_interpreter_would(script, argument):
    path, environment, cwd = script
    environment["A_SCRIPT_VARIABLE"] = "its value"  # Not read on import.
    forked = warm.start([str(path), argument], env=environment, cwd=cwd)
    assert forked.forked
    forked = forked.wait(timeout=120)
    fresh = subprocess.run(
        [sys.executable, str(path), argument],
        env=environment,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    expected = 1 if argument == "raise" else int(argument)
    assert forked.returncode == fresh.returncode == expected
    assert forked.stdout == fresh.stdout
    assert f"cwd {cwd}" in forked.stdout and "atexit ran" in forked.stdout
    assert "kmp imported False" in forked.stdout
    assert "bytecode False" in forked.stdout
    assert f"temporary {cwd.parent / 'temporary'}" in forked.stdout
    assert forked.stderr.startswith("to stderr\n")
    if argument == "raise":
        assert "Traceback" in forked.stderr
        assert forked.stderr.endswith("ValueError: the script's own error\n")
    else:
        assert forked.stderr == fresh.stderr


@pytest.mark.anybackend
def test_modules_and_code_run_as_with_dash_m_and_dash_c(tmp_path):
    (tmp_path / "a_module.py").write_text(
        "import sys; print(sys.argv[1:], __name__)"
    )
    environment = dict(os.environ)
    by_module = warm.run(
        ["-m", "a_module", "x"], env=environment, cwd=tmp_path, timeout=60
    )
    assert by_module.stdout == "['x'] __main__\n", by_module.stderr
    by_code = warm.run(
        ["-c", "import sys; print(sys.argv)", "y"], env=environment, timeout=60
    )
    assert by_code.stdout == "['-c', 'y']\n", by_code.stderr


@pytest.mark.anybackend
def test_a_script_past_its_time_is_killed():
    started = warm.start(["-c", "import time; time.sleep(600)"], env=os.environ)
    with pytest.raises(subprocess.TimeoutExpired):
        started.wait(timeout=1)


@pytest.mark.anybackend
@pytest.mark.parametrize(
    "variable", ["KMP_PATCHES", "KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL"]
)
def test_a_variable_read_on_import_makes_the_interpreter_fresh(variable):
    environment = dict(os.environ, **{variable: "something else"})
    started = warm.start(["-c", "print('ran')"], env=environment)
    assert not started.forked
    started.kill()
    assert not warm.start(["-c", ""], env=os.environ, fresh=True).forked


def test_the_backend_is_not_initialised_before_a_script_runs():
    """A forked script can still configure devices, which a backend
    refuses once initialised."""
    code = {
        "tensorflow": (
            "import tensorflow as tf\n"
            "cpu = tf.config.list_physical_devices('CPU')[0]\n"
            "tf.config.set_logical_device_configuration(\n"
            "    cpu, [tf.config.LogicalDeviceConfiguration()] * 3)\n"
            "print(len(tf.config.list_logical_devices('CPU')))\n"
        ),
        "jax": "import jax; print(len(jax.devices('cpu')))",
        "torch": ("import torch; torch.set_num_interop_threads(1); print(3)"),
    }[backends.NAME]
    environment = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3"
    )
    started = warm.start(["-c", code], env=environment)
    assert started.forked
    result = started.wait(timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "3\n"
