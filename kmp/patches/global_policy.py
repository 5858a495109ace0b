"""Patch `global_policy`: a global policy a user sets holds in every thread.

Keras 3 keeps its global dtype policy per thread. This patch routes Keras's
getter and setter (`keras.config.dtype_policy` / `set_dtype_policy`, their
`keras.mixed_precision` aliases, and every other binding of them in loaded
Keras modules) through `kmp.core.policy`, which adds, as `tf.keras` had:

- the policy a user sets, through any of those setters or
  `kmp.set_global_policy`, is the policy of every thread until it is set
  again or `keras.backend.clear_session()` resets it, as in Keras;
- Keras's implicit default (a float32 or `floatx` policy it creates on first
  use) stays Keras's own, per thread, as without kmp;
- `kmp.policy_scope` blocks, which hold in the thread that entered them.

A policy set before `import kmp` in the importing thread is adopted.
"""

import sys

import keras
from keras.src.backend.common import global_state as _keras_global_state
from keras.src.dtype_policies import dtype_policy as _keras_policy_module

from kmp.core import policy as core_policy
from kmp.patches import registry


def dtype_policy(original):
    """Keras's global policy: the scope's, else the user's, else Keras's."""
    policy = core_policy.scoped_policy()
    if policy is None:
        policy = core_policy.user_policy()
    if policy is not None:
        return policy
    with core_policy.MakingDefault():
        return original()


def set_dtype_policy(original, policy):
    """Keras's setter; the policy a user sets is recorded process-wide."""
    original(policy)  # Keras validates it and sets this thread's policy.
    if not core_policy.making_default():
        core_policy.record_user_policy(
            _keras_global_state.get_global_attribute("dtype_policy")
        )


def _targets():
    originals = {
        registry.keras_original(_keras_policy_module.dtype_policy): (
            dtype_policy
        ),
        registry.keras_original(_keras_policy_module.set_dtype_policy): (
            set_dtype_policy
        ),
    }
    targets = []
    for module_name, module in sorted(sys.modules.items()):
        if module is None or not (
            module_name == "keras" or module_name.startswith("keras.")
        ):
            continue
        for attribute, value in sorted(vars(module).items()):
            if not callable(value):
                continue
            replacement = originals.get(registry.keras_original(value))
            if replacement is not None:
                targets.append(registry.Target(module, attribute, replacement))
    return targets


def _works() -> bool:
    """Whether Keras's layers now find the policy through the patch."""
    from keras.src import dtype_policies

    with core_policy.override_for_check(keras.DTypePolicy("mixed_bfloat16")):
        return (
            dtype_policies.get(None).name == "mixed_bfloat16"
            and keras.config.dtype_policy().name == "mixed_bfloat16"
        )


def _adopt():
    core_policy.adopt_thread_policy(keras.config.floatx())


PATCH = registry.Patch(
    name="global_policy",
    kind=registry.BEHAVIOUR,
    summary=(
        "a global dtype policy a user sets (kmp.set_global_policy or "
        "keras.config.set_dtype_policy) holds in every thread; "
        "kmp.policy_scope holds in its own thread"
    ),
    targets=_targets,
    check=_works,
    on_install=_adopt,
    on_uninstall=core_policy.forget_user_policy,
)
