"""kmp.patches: one visible, reversible, version-checked registry."""

import importlib
import inspect
import os
import subprocess
import sys
import warnings

import keras
import pytest
from keras.src.saving import object_registration

import kmp
from kmp import patches
from kmp.core import backend
from kmp.patches import registry

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair

ALL = ("global_policy", "compile", "hub_compile", "dense", "recurrent", "mean")
DEFAULTS = ALL
TENSORFLOW_ONLY = ("dense", "recurrent", "mean")


def _expected_defaults():
    if backend.is_tensorflow():
        return DEFAULTS
    return ("global_policy", "compile", "hub_compile")


@pytest.fixture(autouse=True)
def _restore_patches():
    yield
    patches.uninstall()
    patches.install(*_expected_defaults())


def _installed_functions():
    for patch in patches._patches():
        for target in patch.targets():
            yield (
                patch,
                target,
                registry._current(target.owner, target.attribute),
            )


def test_available_lists_every_patch_with_its_kind():
    infos = {info.name: info for info in patches.available()}
    assert set(infos) == set(ALL)
    assert infos["global_policy"].kind == "behaviour"
    assert infos["compile"].kind == "behaviour"
    assert infos["hub_compile"].kind == "behaviour"
    for name in TENSORFLOW_ONLY:
        assert infos[name].kind == "performance"
        assert infos[name].applicable == backend.is_tensorflow()
    assert all(info.targets for info in infos.values() if info.applicable)


def test_import_installs_the_defaults():
    assert patches.installed() == _expected_defaults()


def test_installed_functions_say_they_are_kmps_and_keep_keras_signature():
    for patch, _target, function in _installed_functions():
        if not patch.installed:
            continue
        assert function.__kmp_patch__ == patch.name
        assert function.__module__.startswith("kmp.patches.")
        original = function.__kmp_original__
        assert not hasattr(original, "__kmp_patch__")
        assert original.__module__.startswith("keras.")
        assert "kmp patch" in function.__doc__
        assert inspect.signature(function) == inspect.signature(original)


def test_uninstall_all_gives_keras_its_own_functions_back():
    before = [
        (t, f.__kmp_original__)
        for p, t, f in _installed_functions()
        if p.installed
    ]
    patches.uninstall()
    assert patches.installed() == ()
    for target, original in before:
        current = registry._current(target.owner, target.attribute)
        assert current is original
    patches.install()
    assert patches.installed() == _expected_defaults()


@pytest.mark.parametrize("name", DEFAULTS)
def test_each_patch_turns_off_alone(name):
    if name not in _expected_defaults():
        pytest.skip("TensorFlow-only patch")
    patches.uninstall(name)
    assert name not in patches.installed()
    others = set(_expected_defaults()) - {name}
    assert set(patches.installed()) == others
    patches.install(name)
    assert name in patches.installed()


def test_unknown_names_are_refused_with_the_list():
    with pytest.raises(ValueError, match="'dense'.*'global_policy'"):
        patches.install("densee")
    with pytest.raises(ValueError, match="Unknown kmp patch"):
        patches.uninstall("nope")


def test_keras_policy_is_per_thread_with_the_patch_off():
    import threading

    patches.uninstall("global_policy")
    kmp.set_global_policy("mixed_bfloat16")
    seen = []
    thread = threading.Thread(
        target=lambda: seen.append(keras.layers.Dense(1).dtype_policy.name)
    )
    thread.start()
    thread.join()
    assert seen == ["float32"]  # Keras's own per-thread behaviour.
    assert kmp.global_policy().name == "mixed_bfloat16"


@pytest.mark.parametrize(
    "module",
    [
        "kmp.core.policy",
        "kmp.core.optimizer",
        "kmp.patches.registry",
        "kmp.patches.global_policy",
        "kmp.patches.compile",
        "kmp.patches",
        "kmp",
    ]
    + [f"kmp.patches.{name}" for name in TENSORFLOW_ONLY],
)
def test_reloading_a_module_never_wraps_a_wrapper(module):
    if module.split(".")[-1] in TENSORFLOW_ONLY and not backend.is_tensorflow():
        pytest.skip("TensorFlow-only patch")
    reloaded = importlib.import_module(module)
    saved = dict(reloaded.__dict__)
    definitions = _definitions()
    registered = (
        dict(object_registration.GLOBAL_CUSTOM_OBJECTS),
        dict(object_registration.GLOBAL_CUSTOM_NAMES),
    )
    try:
        importlib.reload(reloaded)
        patches.install(*_expected_defaults())
        _check_patches_after_reload()
    finally:
        # Later tests (and kmp's other modules) use the classes and
        # functions of the first import: put them back, also where Keras
        # finds them to load a file.
        reloaded.__dict__.clear()
        reloaded.__dict__.update(saved)
        for registry_dict, before in zip(
            (
                object_registration.GLOBAL_CUSTOM_OBJECTS,
                object_registration.GLOBAL_CUSTOM_NAMES,
            ),
            registered,
        ):
            registry_dict.clear()
            registry_dict.update(before)
        patches.uninstall()
        patches.install(*_expected_defaults())
    # Every module, class, function and registration is the first import's
    # again, and Keras has its own functions behind the same patches.
    assert _definitions() == definitions
    with kmp.policy_scope("mixed_float16"):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)


def _definitions() -> dict:
    """What kmp defines, by identity: its modules' modules, classes and
    functions, the classes it registered with Keras, and which patch (over
    which Keras function) each patched attribute holds."""
    found = {}
    for name, module in list(sys.modules.items()):
        if name != "kmp" and not name.startswith("kmp."):
            continue
        found[name] = id(module)
        for attribute, value in vars(module).items():
            if inspect.ismodule(value) or inspect.isclass(value):
                found[f"{name}.{attribute}"] = id(value)
            elif inspect.isfunction(value):
                found[f"{name}.{attribute}"] = id(value)
    for registry_dict in (
        object_registration.GLOBAL_CUSTOM_OBJECTS,
        object_registration.GLOBAL_CUSTOM_NAMES,
    ):
        for key, value in registry_dict.items():
            found[f"registered {key!r}"] = id(value)
    for _, target, function in _installed_functions():
        found[registry._dotted(target.owner, target.attribute)] = (
            getattr(function, "__kmp_patch__", None),
            id(registry.keras_original(function)),
        )
    return found


def _check_patches_after_reload():
    for _, _, function in _installed_functions():
        if hasattr(function, "__kmp_patch__"):
            assert not hasattr(function.__kmp_original__, "__kmp_patch__")
    with kmp.policy_scope("mixed_float16"):
        model = keras.Sequential(
            [
                keras.Input((2, 3)),
                keras.layers.LSTM(2),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )
        model.compile("sgd", "mse")
        assert model(keras.ops.ones((1, 2, 3))).shape == (1, 1)
        # A reloaded module makes new classes: compare by name.
        assert type(model.optimizer).__qualname__ == "LossScaleOptimizer"
        assert type(model.optimizer).__module__ == "kmp.core.optimizer"
    kmp.set_global_policy("mixed_bfloat16")
    assert keras.layers.Dense(1).dtype_policy.name == "mixed_bfloat16"


def test_performance_patches_stay_off_on_an_untested_keras(monkeypatch):
    monkeypatch.setattr(backend, "keras_version", lambda: (3, 99, 0))
    assert not patches.dense.PATCH.tested if backend.is_tensorflow() else True
    if backend.is_tensorflow():
        patches.uninstall("dense")
        with pytest.raises(RuntimeError, match="not tested"):
            patches.install("dense")
        assert "dense" not in patches.installed()
        patches.install("dense", force=True)
        assert "dense" in patches.installed()
    patches.uninstall()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patches.install_at_import()
    messages = [
        str(w.message) for w in caught if w.category is patches.VersionWarning
    ]
    assert len(messages) == 1
    assert "Keras 3.99.0" in messages[0]
    installed = patches.installed()
    assert "global_policy" in installed and "compile" in installed
    assert not set(installed) & set(TENSORFLOW_ONLY)


def _version_warnings():
    """The `VersionWarning`s `import kmp`'s install gives now."""
    patches.uninstall()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patches.install_at_import()
    return [
        str(w.message) for w in caught if w.category is patches.VersionWarning
    ]


def test_the_installed_releases_are_tested_ones():
    # CI's environments (the newest and oldest pairs, JAX 0.10 and 0.12,
    # torch 2.13) are within the tested ranges: no warning.
    assert _version_warnings() == []


@pytest.mark.parametrize(
    "framework, name",
    [
        pytest.param(framework, name, marks=getattr(pytest.mark, framework))
        for framework, name in (
            ("tensorflow", "TensorFlow"),
            ("jax", "JAX"),
            ("torch", "torch"),
        )
    ],
)
def test_an_untested_backend_release_warns_at_import(
    monkeypatch, framework, name
):
    monkeypatch.setattr(backend, f"{framework}_version", lambda: (9, 99, 0))
    messages = _version_warnings()
    assert len(messages) == 1
    assert f"this is {name} 9.99.0." in messages[0]
    low, high = getattr(registry, f"TESTED_{framework.upper()}")
    assert f"{name} {low[0]}.{low[1]}" in messages[0]
    assert "Keras 3.12-3.15" in messages[0]
    installed = patches.installed()
    assert "global_policy" in installed and "compile" in installed


def test_another_backends_release_is_not_read(monkeypatch):
    # Off its backend, a framework kmp does not use is never imported or
    # named, whatever is installed.
    for framework in ("tensorflow", "jax", "torch"):
        if backend.name() != framework:
            assert getattr(backend, f"{framework}_version")() is None


def test_a_behaviour_patch_that_fails_its_check_is_removed_and_raises(
    monkeypatch,
):
    patch = patches.compile.PATCH
    patches.uninstall("compile")
    monkeypatch.setattr(patch, "_check", lambda: False)
    with pytest.raises(RuntimeError, match="KMP_PATCHES=-compile"):
        patch.install()
    assert "compile" not in patches.installed()


@pytest.mark.parametrize(
    "value, expected",
    [
        ("", DEFAULTS),
        ("default", DEFAULTS),
        ("none", ()),
        (
            "-dense,-recurrent",
            ("global_policy", "compile", "hub_compile", "mean"),
        ),
        ("global_policy", ("global_policy",)),
        ("compile, mean", ("compile", "mean")),
    ],
    ids=["unset", "default", "none", "leave-out", "only", "with-mean"],
)
def test_kmp_patches_environment_variable(monkeypatch, value, expected):
    monkeypatch.setenv(patches.ENVIRONMENT_VARIABLE, value)
    names = tuple(p.name for p in patches._from_environment())
    applicable = [n for n in expected if n in _expected_defaults()]
    if not backend.is_tensorflow():
        applicable = [n for n in applicable if n not in TENSORFLOW_ONLY]
    assert names == tuple(applicable)


@pytest.mark.parametrize("value", ["bogus", "dense,-mean"])
def test_kmp_patches_environment_variable_errors(monkeypatch, value):
    monkeypatch.setenv(patches.ENVIRONMENT_VARIABLE, value)
    with pytest.raises(ValueError, match=value.split(",")[0]):
        patches._from_environment()


def test_import_with_kmp_patches_none_changes_nothing_in_keras():
    code = (
        "import keras; from keras.src.trainers import trainer; "
        "before = trainer.Trainer.compile, keras.config.dtype_policy; "
        "import kmp; "
        "assert (trainer.Trainer.compile, keras.config.dtype_policy) == before;"
        "print(kmp.patches.installed())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, KMP_PATCHES="none", TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("()")
