"""Tests for kmp.policy: the import surface, `Policy` and the global policy."""

import re
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.common import global_state as keras_global_state

import kmp
from kmp import mixed_precision

PUBLIC_NAMES = (
    "LossScaleOptimizer",
    "Policy",
    "global_policy",
    "policy_scope",
    "set_global_policy",
)

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
    "tf_dtype": tf.float16,
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


# --- Import surface ----------------------------------------------------------


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_mixed_precision_reexports_the_same_object(name):
    assert getattr(mixed_precision, name) is getattr(kmp, name)


def test_all_lists_the_public_names():
    assert set(PUBLIC_NAMES) <= set(kmp.__all__)
    tools = {"__version__", "audit", "AuditReport", "callbacks", "convert"}
    tools |= {"dense", "FusedAdam", "mean", "mixed_precision", "recurrent"}
    tools |= {"summary"}
    assert set(kmp.__all__) - set(PUBLIC_NAMES) == tools
    assert sorted(mixed_precision.__all__) == sorted(PUBLIC_NAMES)
    for name in kmp.__all__:
        assert hasattr(kmp, name)


def test_version_is_set():
    assert isinstance(kmp.__version__, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", kmp.__version__)


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


# --- Process-wide global policy ----------------------------------------------


def test_policy_is_seen_by_layers_built_in_another_thread():
    kmp.set_global_policy("mixed_float16")

    def build():
        # Keras keeps its global policy per thread: this thread has none of
        # its own, so without kmp the layer would be float32.
        keras_own = keras_global_state.get_global_attribute("dtype_policy")
        layer = keras.layers.Dense(2)
        return keras_own, layer.dtype_policy.name, kmp.global_policy().name

    keras_own, layer_policy, global_name = _run_in_thread(build)
    assert keras_own is None
    assert layer_policy == "mixed_float16"
    assert global_name == "mixed_float16"


def test_policy_set_in_another_thread_is_seen_in_main_thread():
    _run_in_thread(lambda: kmp.set_global_policy("mixed_bfloat16"))
    assert kmp.global_policy().name == "mixed_bfloat16"
    assert keras.layers.Dense(2).dtype_policy.name == "mixed_bfloat16"


def test_policy_set_through_keras_in_another_thread_is_process_wide():
    _run_in_thread(lambda: keras.config.set_dtype_policy("mixed_float16"))
    assert kmp.global_policy().name == "mixed_float16"
    assert keras.layers.Dense(2).dtype_policy.name == "mixed_float16"


def test_policy_is_seen_inside_replica_function(two_replicas):
    kmp.set_global_policy("mixed_float16")
    seen = []

    def replica_fn(inputs):
        layer = keras.layers.Activation("linear")
        seen.append(
            (
                threading.get_ident(),
                layer.dtype_policy.name,
                kmp.global_policy().name,
            )
        )
        return layer(inputs)

    outputs = two_replicas.run(replica_fn, args=(tf.ones((2,)),))
    assert len(seen) == 2
    assert any(ident != threading.get_ident() for ident, _, _ in seen)
    assert [entry[1:] for entry in seen] == [
        ("mixed_float16", "mixed_float16")
    ] * 2
    for output in two_replicas.experimental_local_results(outputs):
        assert output.dtype == tf.float16


def test_clear_session_keeps_the_policy():
    kmp.set_global_policy("mixed_bfloat16")
    keras.backend.clear_session()
    assert kmp.global_policy().name == "mixed_bfloat16"
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert keras.layers.Dense(2).dtype_policy.name == "mixed_bfloat16"


def test_clear_session_keeps_a_policy_set_through_keras():
    keras.config.set_dtype_policy("mixed_float16")
    keras.backend.clear_session()
    assert kmp.global_policy().name == "mixed_float16"
    assert keras.layers.Dense(2).dtype_policy.name == "mixed_float16"


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


def test_policy_scope_is_process_wide():
    kmp.set_global_policy("float64")

    def read_policy():
        return keras.layers.Dense(2).dtype_policy.name

    with kmp.policy_scope("mixed_float16"):
        assert _run_in_thread(read_policy) == "mixed_float16"
    assert _run_in_thread(read_policy) == "float64"


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
