"""Tests for kmp's import surface: `kmp`, `kmp.mixed_precision` and the thin
re-export modules `kmp.callbacks` and `kmp.testing`."""

import functools
import json
import os
import re
import subprocess
import sys

import pytest

import kmp
from kmp import callbacks
from kmp import mixed_precision
from kmp import testing

# kmp's classes: `isinstance(x, kmp.<name>)` works on every backend.
CLASSES = (
    "FusedAdam",
    "FusedAdamW",
    "FusedSGD",
    "LossScaleOptimizer",
    "LowPrecisionOptimizer",
    "Policy",
)
PUBLIC_NAMES = (
    "LossScaleOptimizer",
    "Policy",
    "global_policy",
    "policy_scope",
    "set_global_policy",
)


@functools.lru_cache(maxsize=None)
def _same_objects_in_a_fresh_interpreter():
    """{name: whether kmp.mixed_precision.<name> is kmp.<name>}, checked in a
    new interpreter: other tests reload kmp's modules in this one."""
    code = (
        "import json, kmp\n"
        "from kmp import mixed_precision\n"
        f"names = {list(PUBLIC_NAMES)!r}\n"
        "print(json.dumps({n: getattr(mixed_precision, n) is getattr(kmp, n)"
        " for n in names}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


# With -n: the fresh interpreter starts once, on one worker.
@pytest.mark.xdist_group("fresh_interpreter")
@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_mixed_precision_reexports_the_same_object(name):
    assert _same_objects_in_a_fresh_interpreter()[name] is True
    assert hasattr(mixed_precision, name)


def test_all_lists_the_public_names():
    assert set(PUBLIC_NAMES) <= set(kmp.__all__)
    tools = {"__version__", "audit", "AuditReport", "callbacks", "convert"}
    tools |= {"FusedAdam", "FusedAdamW", "FusedSGD"}
    tools |= {"LowPrecisionOptimizer", "mixed_precision"}
    tools |= {"patches", "summary"}
    assert set(kmp.__all__) - set(PUBLIC_NAMES) == tools
    # TensorFlow 2.1-2.3's names live in `experimental`, as they did there.
    assert sorted(mixed_precision.__all__) == sorted(
        PUBLIC_NAMES + ("experimental",)
    )
    for name in kmp.__all__:
        assert hasattr(kmp, name)
    for name in mixed_precision.__all__:
        assert hasattr(mixed_precision, name)


def test_version_is_set():
    assert isinstance(kmp.__version__, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", kmp.__version__)


def test_callbacks_and_testing_reexport_the_tools():
    from kmp.tools import monitor
    from kmp.tools import testing as tools_testing

    assert callbacks.__all__ == ["LossScaleMonitor"]
    assert callbacks.LossScaleMonitor is monitor.LossScaleMonitor
    assert sorted(testing.__all__) == ["GradientFaults", "OverflowAt"]
    assert testing.GradientFaults is tools_testing.GradientFaults
    assert testing.OverflowAt is tools_testing.OverflowAt


@pytest.mark.parametrize(
    "module, name",
    [
        (kmp, "AuditReport"),
        (callbacks, "LossScaleMonitor"),
        (testing, "GradientFaults"),
        (testing, "OverflowAt"),
    ],
    ids=["AuditReport", "LossScaleMonitor", "GradientFaults", "OverflowAt"],
)
def test_tool_classes_are_classes_on_every_backend(module, name):
    # isinstance(x, kmp.AuditReport) raised TypeError off TensorFlow, where
    # it was a function that refused to run.
    cls = getattr(module, name)
    assert isinstance(cls, type)
    assert not isinstance(object(), cls)


@pytest.mark.parametrize("name", CLASSES)
def test_every_class_is_a_class_on_every_backend(name):
    cls = getattr(kmp, name)
    assert isinstance(cls, type)
    assert not isinstance(object(), cls)


@pytest.mark.jax
def test_fused_adam_on_jax_says_what_to_use():
    with pytest.raises(RuntimeError) as info:
        kmp.FusedAdam(0.01)
    assert "needs Keras's TensorFlow or torch backend" in str(info.value)
    assert "keras.optimizers.Adam" in str(info.value)


@pytest.mark.jax
@pytest.mark.tensorflow
@pytest.mark.parametrize("name", ["FusedAdamW", "FusedSGD"])
def test_torchs_fused_optimizers_elsewhere_say_what_to_use(name):
    with pytest.raises(RuntimeError) as info:
        getattr(kmp, name)(0.01)
    assert "needs Keras's torch backend" in str(info.value)
    assert f"keras.optimizers.{name[5:]}" in str(info.value)


@pytest.mark.anybackend
@pytest.mark.xdist_group("grouping_check")
def test_xdist_groups_reach_the_scheduler(request):
    # Under `-n` with `--dist loadgroup` (setup.cfg) a test of an xdist_group
    # carries the group in its node id, which is how the scheduler keeps a
    # group on one worker (pytest 9 with pytest-xdist 3.8 loses it).
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("not run by a pytest-xdist worker")
    assert request.node.nodeid.endswith("@grouping_check")
