"""Tests for kmp.core.policy: `Policy`, the global policy and `policy_scope`.

What the `global_policy` patch adds (a policy seen by every thread) is tested
in tests/patches/test_global_policy.py; the import surface in
tests/test_package.py.
"""

import asyncio
import re
import threading

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kmp
from kmp.core.policy import POLICY_NAMES
from tests.support import backends
from tests.support.fuzzing import FUZZ
from tests.support.fuzzing import call_expecting_clean_error
from tests.support.fuzzing import junk

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair

# name -> (compute dtype, variable dtype)
POLICY_DTYPES = {
    "float16": ("float16", "float16"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "float32": ("float32", "float32"),
    "float64": ("float64", "float64"),
    "mixed_float16": ("float16", "float32"),
    "mixed_bfloat16": ("bfloat16", "float32"),
}

# Names Keras itself accepts as policies (the first four) or that look like
# policies, none of which kmp supports.
INVALID_NAMES = (
    "int32",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "mixed_int8",
    "mixed_float32",
    "foo",
)
KERAS_ACCEPTED_NAMES = ("int32", "uint8", "bool", "float8_e4m3fn")

NON_STRING_NAMES = {
    "int": 16,
    "bytes": b"float16",
    "backend_dtype": backends.native_dtype("float16"),
    "numpy_dtype": np.dtype("float16"),
    "list": ["float16"],
}

# The error message lists every valid name, as a user reads it.
VALID_NAMES_FRAGMENT = re.escape(
    "'float16', 'bfloat16', 'float32', 'float64', 'mixed_float16', "
    "'mixed_bfloat16'"
)


def _run_in_thread(function):
    """Runs `function` in a new thread and returns its result (or raises)."""
    outcome = {}

    def target():
        try:
            outcome["result"] = function()
        except BaseException as error:  # Re-raised in the calling thread.
            outcome["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


# --- Policy ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(POLICY_DTYPES))
def test_policy_dtypes_are_strings(name):
    policy = kmp.Policy(name)
    compute_dtype, variable_dtype = POLICY_DTYPES[name]
    assert policy.name == name
    assert policy.compute_dtype == compute_dtype
    assert policy.variable_dtype == variable_dtype
    for value in (policy.name, policy.compute_dtype, policy.variable_dtype):
        assert type(value) is str


@pytest.mark.parametrize("name", list(POLICY_DTYPES))
def test_policy_repr(name):
    assert repr(kmp.Policy(name)) == f'<Policy "{name}">'


def test_policy_repr_mixed_float16():
    assert repr(kmp.Policy("mixed_float16")) == '<Policy "mixed_float16">'


@pytest.mark.parametrize("name", list(POLICY_DTYPES))
def test_policy_config_round_trip(name):
    config = kmp.Policy(name).get_config()
    assert config == {"name": name}
    restored = kmp.Policy.from_config(config)
    assert isinstance(restored, kmp.Policy)
    assert restored.name == name
    assert restored == kmp.Policy(name)


@pytest.mark.parametrize("name", KERAS_ACCEPTED_NAMES)
def test_keras_accepts_names_that_kmp_rejects(name):
    # The gap kmp closes: Keras builds a policy from these names.
    assert keras.DTypePolicy(name).name == name
    with pytest.raises(ValueError):
        kmp.Policy(name)


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_policy_rejects_invalid_name(name):
    with pytest.raises(ValueError, match=VALID_NAMES_FRAGMENT) as info:
        kmp.Policy(name)
    assert repr(name) in str(info.value)


@pytest.mark.parametrize(
    "name", list(NON_STRING_NAMES.values()), ids=list(NON_STRING_NAMES)
)
def test_policy_rejects_non_string_name(name):
    with pytest.raises(TypeError, match="must be a policy name"):
        kmp.Policy(name)


@pytest.mark.parametrize(
    "policy",
    [kmp.Policy("float32"), keras.DTypePolicy("float32")],
    ids=["kmp", "keras"],
)
def test_policy_of_a_policy_names_only_what_it_accepts(policy):
    with pytest.raises(TypeError) as info:
        kmp.Policy(policy)
    message = str(info.value)
    assert message.startswith(
        "'name' must be a policy name (a string), one of 'float16'"
    )
    assert "kmp.Policy" not in message.split("Received")[0]


def test_policy_rejects_none_name():
    with pytest.raises(TypeError, match="Received: name=None"):
        kmp.Policy(None)


@pytest.mark.parametrize(
    "config",
    [{"name": "int32"}, {"name": "foo"}],
    ids=["int32", "foo"],
)
def test_from_config_validates_the_name(config):
    with pytest.raises(ValueError, match=VALID_NAMES_FRAGMENT):
        kmp.Policy.from_config(config)


@pytest.mark.parametrize("name", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_policy_is_accepted_as_layer_dtype(name):
    layer = keras.layers.Dense(4, dtype=kmp.Policy(name))
    assert layer.dtype_policy.name == name
    assert layer.compute_dtype == POLICY_DTYPES[name][0]
    outputs = layer(np.ones((2, 3), "float32"))
    assert (
        keras.backend.standardize_dtype(outputs.dtype)
        == (POLICY_DTYPES[name][0])
    )
    assert layer.kernel.dtype == POLICY_DTYPES[name][1]


@pytest.mark.parametrize("name", list(POLICY_DTYPES))
def test_policy_equals_keras_policy_of_same_name(name):
    policy = kmp.Policy(name)
    keras_policy = keras.DTypePolicy(name)
    assert policy == keras_policy
    assert keras_policy == policy
    assert not policy != keras_policy
    assert policy == kmp.Policy(name)


def test_policy_differs_from_other_names():
    policy = kmp.Policy("mixed_float16")
    assert policy != kmp.Policy("mixed_bfloat16")
    assert policy != keras.DTypePolicy("float16")
    assert keras.DTypePolicy("float32") != policy


def test_policy_is_hashable():
    policies = {kmp.Policy(name) for name in POLICY_DTYPES}
    policies |= {kmp.Policy(name) for name in POLICY_DTYPES}
    assert len(policies) == len(POLICY_DTYPES)
    assert hash(kmp.Policy("float16")) == hash(kmp.Policy("float16"))
    by_policy = {kmp.Policy("mixed_float16"): "half"}
    assert by_policy[kmp.Policy("mixed_float16")] == "half"


# --- set_global_policy and global_policy -------------------------------------


def test_global_policy_defaults_to_float32():
    policy = kmp.global_policy()
    assert isinstance(policy, kmp.Policy)
    assert policy.name == "float32"


@pytest.mark.parametrize(
    "make_policy",
    [lambda name: name, kmp.Policy],
    ids=["name", "policy"],
)
@pytest.mark.parametrize("name", list(POLICY_DTYPES))
def test_set_global_policy(make_policy, name):
    kmp.set_global_policy(make_policy(name))
    policy = kmp.global_policy()
    assert isinstance(policy, kmp.Policy)
    assert policy.name == name
    layer = keras.layers.Dense(2)
    assert layer.dtype_policy.name == name
    assert layer.compute_dtype == POLICY_DTYPES[name][0]
    assert layer.variable_dtype == POLICY_DTYPES[name][1]


def test_set_global_policy_none_resets_to_float32():
    # Keras has no such shortcut: its setter rejects None.
    with pytest.raises(ValueError, match="Received: policy=None"):
        keras.config.set_dtype_policy(None)
    kmp.set_global_policy("mixed_float16")
    kmp.set_global_policy(None)
    assert kmp.global_policy().name == "float32"
    assert keras.config.dtype_policy().name == "float32"
    assert keras.layers.Dense(2).dtype_policy.name == "float32"


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_set_global_policy_rejects_invalid_name(name):
    kmp.set_global_policy("mixed_bfloat16")
    with pytest.raises(ValueError, match=VALID_NAMES_FRAGMENT) as info:
        kmp.set_global_policy(name)
    assert repr(name) in str(info.value)
    assert kmp.global_policy().name == "mixed_bfloat16"
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


@pytest.mark.parametrize(
    "policy", list(NON_STRING_NAMES.values()), ids=list(NON_STRING_NAMES)
)
def test_set_global_policy_rejects_non_string(policy):
    kmp.set_global_policy("mixed_bfloat16")
    with pytest.raises(TypeError, match="must be a policy name"):
        kmp.set_global_policy(policy)
    assert kmp.global_policy().name == "mixed_bfloat16"
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


@pytest.mark.parametrize("name", KERAS_ACCEPTED_NAMES)
def test_set_global_policy_rejects_keras_policy_of_invalid_name(name):
    kmp.set_global_policy("mixed_bfloat16")
    with pytest.raises(ValueError, match=VALID_NAMES_FRAGMENT):
        kmp.set_global_policy(keras.DTypePolicy(name))
    assert kmp.global_policy().name == "mixed_bfloat16"


def test_policy_set_through_keras_shows_in_kmp():
    keras.config.set_dtype_policy("mixed_float16")
    assert kmp.global_policy() == kmp.Policy("mixed_float16")
    assert isinstance(kmp.global_policy(), kmp.Policy)
    keras.config.set_dtype_policy(keras.DTypePolicy("mixed_bfloat16"))
    assert kmp.global_policy().name == "mixed_bfloat16"
    keras.mixed_precision.set_global_policy("float64")
    assert kmp.global_policy().name == "float64"


def test_policy_set_through_kmp_shows_in_keras():
    kmp.set_global_policy("mixed_float16")
    assert keras.config.dtype_policy().name == "mixed_float16"
    assert keras.mixed_precision.global_policy().name == "mixed_float16"
    kmp.set_global_policy(kmp.Policy("mixed_bfloat16"))
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


def test_global_policy_rejects_unsupported_policy_set_through_keras():
    keras.config.set_dtype_policy("int32")
    with pytest.raises(ValueError, match="kmp.set_global_policy"):
        kmp.global_policy()


# --- policy_scope ------------------------------------------------------------


@pytest.mark.parametrize(
    "make_policy",
    [lambda name: name, kmp.Policy],
    ids=["name", "policy"],
)
def test_policy_scope_sets_and_restores(make_policy):
    kmp.set_global_policy("float64")
    with kmp.policy_scope(make_policy("mixed_float16")) as policy:
        assert isinstance(policy, kmp.Policy)
        assert policy.name == "mixed_float16"
        assert kmp.global_policy().name == "mixed_float16"
        assert keras.config.dtype_policy().name == "mixed_float16"
        inside = keras.layers.Dense(2)
    assert inside.dtype_policy.name == "mixed_float16"
    assert kmp.global_policy().name == "float64"
    assert keras.config.dtype_policy().name == "float64"
    assert keras.layers.Dense(2).dtype_policy.name == "float64"


def test_policy_scope_none_is_float32():
    kmp.set_global_policy("mixed_float16")
    with kmp.policy_scope(None):
        assert kmp.global_policy().name == "float32"
    assert kmp.global_policy().name == "mixed_float16"


def test_policy_scope_restores_when_block_raises():
    kmp.set_global_policy("mixed_bfloat16")
    with pytest.raises(RuntimeError, match="inside the scope"):
        with kmp.policy_scope("float16"):
            assert kmp.global_policy().name == "float16"
            raise RuntimeError("inside the scope")
    assert kmp.global_policy().name == "mixed_bfloat16"
    assert keras.layers.Dense(2).dtype_policy.name == "mixed_bfloat16"


def test_policy_scopes_nest():
    with kmp.policy_scope("mixed_float16"):
        with kmp.policy_scope("mixed_bfloat16"):
            assert kmp.global_policy().name == "mixed_bfloat16"
            with kmp.policy_scope("float64"):
                assert kmp.global_policy().name == "float64"
            assert kmp.global_policy().name == "mixed_bfloat16"
        assert kmp.global_policy().name == "mixed_float16"
    assert kmp.global_policy().name == "float32"


def test_policy_scope_restores_a_policy_set_through_keras():
    keras.config.set_dtype_policy("mixed_float16")
    with kmp.policy_scope("float64"):
        assert keras.config.dtype_policy().name == "float64"
    assert kmp.global_policy().name == "mixed_float16"
    assert keras.config.dtype_policy().name == "mixed_float16"


def test_policy_scope_holds_only_in_its_own_thread():
    # Changed on purpose: a scope used to be process-wide; now other threads
    # keep seeing the process-wide policy while it is open.
    kmp.set_global_policy("float64")

    def read_policy():
        return keras.layers.Dense(2).dtype_policy.name, kmp.global_policy().name

    with kmp.policy_scope("mixed_float16"):
        assert _run_in_thread(read_policy) == ("float64", "float64")
        assert read_policy() == ("mixed_float16", "mixed_float16")
    assert _run_in_thread(read_policy) == ("float64", "float64")
    assert read_policy() == ("float64", "float64")


def test_overlapping_scopes_in_two_threads_each_see_their_own():
    kmp.set_global_policy("float64")
    inside = threading.Barrier(2)
    seen = {}

    def scoped(name):
        def run():
            with kmp.policy_scope(name):
                inside.wait(timeout=30)  # Both scopes are open now.
                seen[name] = keras.layers.Dense(2).dtype_policy.name
                inside.wait(timeout=30)
            return kmp.global_policy().name

        return run

    threads = [
        threading.Thread(target=scoped(name))
        for name in ("mixed_float16", "mixed_bfloat16")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {
        "mixed_float16": "mixed_float16",
        "mixed_bfloat16": "mixed_bfloat16",
    }
    # Nothing is left behind once both have exited.
    assert kmp.global_policy().name == "float64"
    assert _run_in_thread(lambda: kmp.global_policy().name) == "float64"


def test_overlapping_scopes_in_two_asyncio_tasks_each_see_their_own():
    seen = {}

    async def scoped(name, entered, other_entered):
        with kmp.policy_scope(name):
            entered.set()
            await other_entered.wait()  # The other task's scope is open.
            seen[name] = kmp.global_policy().name

    async def main():
        first, second = asyncio.Event(), asyncio.Event()
        await asyncio.gather(
            scoped("mixed_float16", first, second),
            scoped("mixed_bfloat16", second, first),
        )

    asyncio.run(main())
    assert seen == {
        "mixed_float16": "mixed_float16",
        "mixed_bfloat16": "mixed_bfloat16",
    }
    assert kmp.global_policy().name == "float32"


def test_one_policy_scope_may_be_entered_again():
    scope = kmp.policy_scope("mixed_bfloat16")
    for _ in range(2):
        with scope as policy:
            assert policy == kmp.Policy("mixed_bfloat16")
            assert kmp.global_policy().name == "mixed_bfloat16"
        assert kmp.global_policy().name == "float32"
    with scope:
        with kmp.policy_scope("float64"):
            with scope:  # Also while inside it.
                assert kmp.global_policy().name == "mixed_bfloat16"
            assert kmp.global_policy().name == "float64"
        assert kmp.global_policy().name == "mixed_bfloat16"
    assert kmp.global_policy().name == "float32"


def test_set_global_policy_inside_a_scope_ends_with_the_scope():
    kmp.set_global_policy("float64")
    with kmp.policy_scope("mixed_float16"):
        kmp.set_global_policy("mixed_bfloat16")
        assert kmp.global_policy().name == "mixed_bfloat16"
        assert keras.layers.Dense(2).dtype_policy.name == "mixed_bfloat16"
    assert kmp.global_policy().name == "float64"
    assert keras.layers.Dense(2).dtype_policy.name == "float64"


def test_set_global_policy_message_lists_every_accepted_kind():
    with pytest.raises(TypeError) as info:
        kmp.set_global_policy(16)
    allowed = str(info.value).split("Received")[0]
    for kind in ("a string", "kmp.Policy", "keras.DTypePolicy", "None"):
        assert kind in allowed


def test_policy_scope_checks_the_policy_when_called():
    kmp.set_global_policy("mixed_bfloat16")
    with pytest.raises(ValueError, match=VALID_NAMES_FRAGMENT):
        kmp.policy_scope("bogus")  # No `with`: refused at the call.
    assert kmp.global_policy().name == "mixed_bfloat16"


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_policy_scope_rejects_invalid_name(name):
    kmp.set_global_policy("mixed_bfloat16")
    entered = False
    with pytest.raises(ValueError, match=VALID_NAMES_FRAGMENT):
        with kmp.policy_scope(name):
            entered = True
    assert not entered
    assert kmp.global_policy().name == "mixed_bfloat16"
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


@pytest.mark.parametrize(
    "policy", list(NON_STRING_NAMES.values()), ids=list(NON_STRING_NAMES)
)
def test_policy_scope_rejects_non_string(policy):
    kmp.set_global_policy("mixed_bfloat16")
    entered = False
    with pytest.raises(TypeError, match="must be a policy name"):
        with kmp.policy_scope(policy):
            entered = True
    assert not entered
    assert kmp.global_policy().name == "mixed_bfloat16"


# --- Fuzzing: bad input gets a clean error and changes nothing ---------------


@FUZZ
@given(name=junk().filter(lambda v: not isinstance(v, str)) | st.text())
def test_policy_rejects_anything_but_a_policy_name(name):
    if isinstance(name, str) and name in POLICY_NAMES:
        assert kmp.Policy(name).name == name
        return
    error = call_expecting_clean_error(lambda: kmp.Policy(name), name)
    assert error is not None
    assert isinstance(error, ValueError if isinstance(name, str) else TypeError)
    assert "mixed_float16" in str(error)  # It lists what is allowed.


@FUZZ
@given(
    start=st.sampled_from(POLICY_NAMES),
    config=st.one_of(
        junk(),
        st.dictionaries(
            st.sampled_from(["name", "Name", "config", "dtype"]),
            junk() | st.sampled_from(POLICY_NAMES),
            max_size=3,
        ),
    ),
)
def test_policy_from_config_rejects_bad_configs(start, config):
    kmp.set_global_policy(start)
    valid = (
        isinstance(config, dict)
        and set(config) == {"name"}
        and isinstance(config["name"], str)
        and config["name"] in POLICY_NAMES
    )
    if valid:
        assert kmp.Policy.from_config(config).name == config["name"]
    else:
        bad = config
        if isinstance(config, dict) and set(config) == {"name"}:
            bad = config["name"]
        error = call_expecting_clean_error(
            lambda: kmp.Policy.from_config(config), bad
        )
        assert error is not None
    assert kmp.global_policy().name == start


@FUZZ
@given(
    start=st.sampled_from(POLICY_NAMES),
    policy=junk().filter(lambda v: v is not None),
)
def test_set_global_policy_rejects_bad_policies_and_changes_nothing(
    start, policy
):
    kmp.set_global_policy(start)
    if isinstance(policy, str) and policy in POLICY_NAMES:
        return
    error = call_expecting_clean_error(
        lambda: kmp.set_global_policy(policy), policy
    )
    assert error is not None
    assert kmp.global_policy().name == start
    assert keras.config.dtype_policy().name == start


@FUZZ
@given(
    outer=st.sampled_from(POLICY_NAMES),
    inner=junk().filter(lambda v: v is not None),
)
def test_policy_scope_rejects_bad_policies_and_changes_nothing(outer, inner):
    if isinstance(inner, str) and inner in POLICY_NAMES:
        return

    def enter_bad_scope():
        with kmp.policy_scope(inner):
            pytest.fail("the block of a bad policy_scope ran")

    with kmp.policy_scope(outer):
        error = call_expecting_clean_error(enter_bad_scope, inner)
        assert error is not None
        assert kmp.global_policy().name == outer
    assert kmp.global_policy().name == "float32"


def test_policy_scope_restores_after_the_block_raises_value_error():
    with pytest.raises(ValueError, match="inside"):
        with kmp.policy_scope("mixed_float16"):
            raise ValueError("inside")
    assert kmp.global_policy().name == "float32"
