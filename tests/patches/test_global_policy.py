"""Tests for the `global_policy` patch: a policy a user sets holds in every
thread, as in `tf.keras`, and Keras's own implicit default stays Keras's."""

import threading

import keras
import pytest
from keras.src.backend.common import global_state as keras_global_state

import kmp
from tests.support import backends

# Reaches into Keras or TensorFlow: CI runs it on the oldest pair too.
pytestmark = pytest.mark.oldest_pair


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


def test_importing_kmp_installs_it():
    assert "global_policy" in kmp.patches.installed()
    assert keras.config.dtype_policy.__kmp_patch__ == "global_policy"


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


@pytest.mark.tensorflow
def test_policy_is_seen_inside_replica_function(two_replicas):
    tf = backends.tensorflow()
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


def test_kerass_implicit_default_is_not_made_process_wide():
    # A thread that reads the policy first makes Keras create its default
    # (float32, from floatx) there; that is not a policy a user set, so it
    # must not become every thread's: here floatx decides, as in Keras.
    keras.backend.clear_session()
    assert _run_in_thread(lambda: keras.config.dtype_policy().name) == (
        "float32"
    )
    floatx = keras.config.floatx()
    keras.config.set_floatx("float64")
    try:
        assert keras.config.dtype_policy().name == "float64"
        assert keras.layers.Dense(2).dtype_policy.name == "float64"
    finally:
        keras.config.set_floatx(floatx)
        keras.backend.clear_session()


# --- clear_session ------------------------------------------------------------
# Changed on purpose: `keras.backend.clear_session()` used to keep a policy
# the user set; now it resets it, exactly as Keras does without kmp.


def test_clear_session_resets_the_policy_as_keras_does():
    kmp.set_global_policy("mixed_bfloat16")
    keras.backend.clear_session()
    assert kmp.global_policy().name == "float32"
    assert keras.config.dtype_policy().name == "float32"
    assert keras.layers.Dense(2).dtype_policy.name == "float32"
    assert _run_in_thread(lambda: kmp.global_policy().name) == "float32"


def test_clear_session_resets_a_policy_set_through_keras():
    keras.config.set_dtype_policy("mixed_float16")
    keras.backend.clear_session()
    assert kmp.global_policy().name == "float32"
    assert keras.layers.Dense(2).dtype_policy.name == "float32"


def test_policy_set_after_clear_session_is_process_wide_again():
    kmp.set_global_policy("mixed_bfloat16")
    keras.backend.clear_session()
    kmp.set_global_policy("mixed_float16")
    assert _run_in_thread(lambda: kmp.global_policy().name) == "mixed_float16"


def test_clear_session_inside_a_scope_does_not_bring_the_scope_back():
    kmp.set_global_policy("float64")
    with kmp.policy_scope("mixed_float16"):
        keras.backend.clear_session()
    assert kmp.global_policy().name == "float32"


# --- Uninstalling -------------------------------------------------------------


def test_uninstall_gives_keras_its_per_thread_policy_back():
    kmp.set_global_policy("mixed_float16")
    kmp.patches.uninstall("global_policy")
    try:
        assert "global_policy" not in kmp.patches.installed()
        assert not hasattr(keras.config.dtype_policy, "__kmp_patch__")
        # This thread keeps what it set; another thread sees Keras's default.
        assert kmp.global_policy().name == "mixed_float16"
        assert _run_in_thread(lambda: kmp.global_policy().name) == "float32"
        # Scopes still hold in their thread.
        with kmp.policy_scope("mixed_bfloat16"):
            assert keras.layers.Dense(2).dtype_policy.name == "mixed_bfloat16"
        assert kmp.global_policy().name == "mixed_float16"
    finally:
        kmp.patches.install("global_policy")
    assert "global_policy" in kmp.patches.installed()
    kmp.set_global_policy("mixed_bfloat16")
    assert _run_in_thread(lambda: kmp.global_policy().name) == "mixed_bfloat16"
