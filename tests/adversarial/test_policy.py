"""Policies, the global policy and scopes, misused; in threads and tasks."""

import asyncio
import threading

import keras
import numpy as np
import pytest

import kmp
from kmp import mixed_precision

NAMES = [
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "mixed_float16",
    "mixed_bfloat16",
]
BAD_NAMES = [
    "int32",
    "mixed_int8",
    "mixed_float32",
    "foo",
    "",
    "Mixed_Float16",
    " float32",
    "float8_e4m3fn",
    "int8_from_mixed_float16",
    "float16_from_float32",
    "mixed_float16 ",
]
NON_STRINGS = [1, 16.0, b"float16", ["float32"], ("float32",), object()]


def in_thread(function):
    out = {}

    def run():
        try:
            out["value"] = function()
        except BaseException as error:  # noqa: BLE001 - reported below.
            out["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("name", BAD_NAMES)
@pytest.mark.parametrize(
    "entry", ["Policy", "set_global_policy", "policy_scope"]
)
def test_bad_name_refused_with_the_valid_names(entry, name):
    kmp.set_global_policy("mixed_bfloat16")
    call = getattr(kmp, entry)
    with pytest.raises(ValueError) as info:
        call(name)
    for valid in NAMES:
        assert repr(valid) in str(info.value)
    assert repr(name) in str(info.value)
    assert kmp.global_policy().name == "mixed_bfloat16"


@pytest.mark.parametrize("name", NON_STRINGS, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize(
    "entry", ["Policy", "set_global_policy", "policy_scope"]
)
def test_non_string_refused_with_type_error(entry, name):
    kmp.set_global_policy("mixed_bfloat16")
    with pytest.raises(TypeError):
        getattr(kmp, entry)(name)
    assert kmp.global_policy().name == "mixed_bfloat16"


def test_policy_none_is_a_type_error_but_set_none_is_float32():
    with pytest.raises(TypeError):
        kmp.Policy(None)
    kmp.set_global_policy("float16")
    kmp.set_global_policy(None)
    assert kmp.global_policy() == kmp.Policy("float32")


@pytest.mark.parametrize(
    "policy",
    ["int8_from_float32", "float8_from_float32"],
)
def test_quantized_keras_policy_refused(policy):
    quantized = keras.dtype_policies.get(policy)
    kmp.set_global_policy("mixed_float16")
    with pytest.raises(ValueError):
        kmp.set_global_policy(quantized)
    with pytest.raises(ValueError):
        kmp.policy_scope(quantized)
    assert kmp.global_policy().name == "mixed_float16"


def test_global_policy_set_through_keras_to_a_non_floating_one():
    keras.config.set_dtype_policy("int8_from_float32")
    try:
        with pytest.raises(ValueError, match="set_global_policy"):
            kmp.global_policy()
    finally:
        kmp.set_global_policy(None)


@pytest.mark.parametrize("name", NAMES)
def test_policy_values(name):
    policy = kmp.Policy(name)
    compute = name.replace("mixed_", "")
    variable = "float32" if name.startswith("mixed_") else name
    assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (
        name,
        compute,
        variable,
    )
    assert repr(policy) == f'<Policy "{name}">'
    assert kmp.Policy.from_config(policy.get_config()) == policy
    assert policy.get_config() == {"name": name}
    assert mixed_precision.Policy is kmp.Policy
    layer = keras.layers.Dense(2, dtype=policy)
    assert layer.compute_dtype == compute
    assert layer.variable_dtype == variable


@pytest.mark.parametrize(
    "config",
    [
        {"name": "int8"},
        {"name": "float32", "extra": 1},
        {"name": 32},
        {},
        "float32",
        None,
    ],
    ids=["bad_name", "extra_key", "int_name", "empty", "string", "none"],
)
def test_policy_from_tampered_config(config):
    with pytest.raises((TypeError, ValueError)):
        kmp.Policy.from_config(config)


def test_keras_and_kmp_share_one_global_policy():
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert kmp.global_policy() == kmp.Policy("mixed_bfloat16")
    kmp.set_global_policy("float64")
    assert keras.config.dtype_policy().name == "float64"
    assert keras.layers.Dense(1).dtype_policy.name == "float64"


def test_scope_restores_on_exception_and_nests():
    kmp.set_global_policy("float64")
    with pytest.raises(RuntimeError):
        with kmp.policy_scope("mixed_float16"):
            with kmp.policy_scope("bfloat16"):
                assert kmp.global_policy().name == "bfloat16"
                raise RuntimeError("inside")
    assert kmp.global_policy().name == "float64"
    with kmp.policy_scope("mixed_bfloat16") as policy:
        assert policy == kmp.Policy("mixed_bfloat16")
        assert keras.layers.Dense(1).dtype_policy.name == "mixed_bfloat16"
        with kmp.policy_scope(None):
            assert kmp.global_policy().name == "float32"
        assert kmp.global_policy().name == "mixed_bfloat16"
    assert kmp.global_policy().name == "float64"


def test_set_global_policy_inside_a_scope_ends_with_it():
    kmp.set_global_policy("float64")
    with kmp.policy_scope("mixed_float16"):
        kmp.set_global_policy("bfloat16")
        assert kmp.global_policy().name == "bfloat16"
    assert kmp.global_policy().name == "float64"


def test_one_scope_object_reentered_and_reused():
    kmp.set_global_policy("float64")
    scope = kmp.policy_scope("mixed_float16")
    with scope:
        with kmp.policy_scope("bfloat16"):
            with scope:
                assert kmp.global_policy().name == "mixed_float16"
            assert kmp.global_policy().name == "bfloat16"
        assert kmp.global_policy().name == "mixed_float16"
    assert kmp.global_policy().name == "float64"
    for _ in range(3):
        with scope:
            pass
    assert kmp.global_policy().name == "float64"


def test_set_policy_is_seen_by_every_thread():
    kmp.set_global_policy("mixed_bfloat16")
    assert in_thread(lambda: kmp.global_policy().name) == "mixed_bfloat16"
    assert (
        in_thread(lambda: keras.layers.Dense(1).dtype_policy.name)
        == "mixed_bfloat16"
    )
    in_thread(lambda: kmp.set_global_policy("float64"))
    assert kmp.global_policy().name == "float64"


def test_scope_holds_in_its_thread_only():
    """kmp.core.policy: a scope holds in the thread that entered it."""
    kmp.set_global_policy("float64")
    entered = threading.Event()
    release = threading.Event()
    seen = {}

    def worker():
        with kmp.policy_scope("mixed_float16"):
            entered.set()
            release.wait(10)
            seen["worker"] = keras.layers.Dense(1).dtype_policy.name
        seen["worker_after"] = kmp.global_policy().name

    thread = threading.Thread(target=worker)
    thread.start()
    entered.wait(10)
    seen["main"] = kmp.global_policy().name
    with kmp.policy_scope("bfloat16"):
        release.set()
        thread.join()
        seen["main_in_scope"] = kmp.global_policy().name
    assert seen == {
        "worker": "mixed_float16",
        "worker_after": "float64",
        "main": "float64",
        "main_in_scope": "bfloat16",
    }
    assert kmp.global_policy().name == "float64"


def test_one_scope_object_entered_by_two_threads():
    kmp.set_global_policy("float64")
    scope = kmp.policy_scope("mixed_bfloat16")
    barrier = threading.Barrier(2)
    seen = []

    def worker():
        with scope:
            barrier.wait(10)
            seen.append(kmp.global_policy().name)
            barrier.wait(10)
        seen.append(kmp.global_policy().name)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(seen) == ["float64"] * 2 + ["mixed_bfloat16"] * 2
    assert kmp.global_policy().name == "float64"


def test_scopes_in_overlapping_asyncio_tasks():
    kmp.set_global_policy("float64")

    async def task(name, first, second):
        with kmp.policy_scope(name):
            first.set()
            await second.wait()
            return kmp.global_policy().name

    async def main():
        a, b = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(
            task("mixed_float16", a, b), task("bfloat16", b, a)
        )

    assert asyncio.run(main()) == ["mixed_float16", "bfloat16"]
    assert kmp.global_policy().name == "float64"


def test_layer_inputs_cast_under_a_mixed_policy():
    kmp.set_global_policy("mixed_float16")
    layer = keras.layers.Dense(2)
    out = layer(np.ones((1, 3), "float64"))
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    assert layer.kernel.dtype == "float32"
    # Integer inputs are left alone (an Embedding's ids).
    embedding = keras.layers.Embedding(5, 2)
    out = embedding(np.array([[1, 2]], "int32"))
    assert keras.backend.standardize_dtype(out.dtype) == "float16"


def test_keras_file_keeps_each_layers_policy(tmp_path):
    kmp.set_global_policy("mixed_bfloat16")
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4),
            keras.layers.Dense(2, dtype=kmp.Policy("float32")),
        ]
    )
    path = str(tmp_path / "m.keras")
    model.save(path)
    kmp.set_global_policy("float64")
    loaded = keras.saving.load_model(path)
    assert [layer.dtype_policy.name for layer in loaded.layers] == [
        "mixed_bfloat16",
        "float32",
    ]
