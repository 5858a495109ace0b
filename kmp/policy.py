"""Dtype policies: the dtype a layer computes in and the one it stores in.

`Policy` is a Keras `DTypePolicy` restricted to the six floating policies, so
it is accepted wherever Keras takes `dtype=`. The global policy is Keras's own
global policy, with two differences that kmp makes when it is imported:

- It is process-wide, as it was in `tf.keras` (Keras 2). Keras 3 keeps the
  global policy per thread, so a layer built in another thread, or inside a
  `tf.distribute` replica function (MirroredStrategy runs those in threads),
  would silently get float32. With kmp imported, the policy set by
  `kmp.set_global_policy` or `keras.config.set_dtype_policy` in any thread is
  the one every thread sees.
- `keras.backend.clear_session()` no longer resets it; `set_global_policy(None)`
  does (back to `"float32"`).
"""

import contextlib
import threading
from typing import ContextManager
from typing import Iterator
from typing import Optional
from typing import Union

from keras.src.backend.common import global_state as _keras_global_state
from keras.src.dtype_policies import dtype_policy as _keras_policy_module

from kmp import doctor as _doctor
from kmp._backend import keras

POLICY_NAMES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "mixed_float16",
    "mixed_bfloat16",
)

_VALID_NAMES_TEXT = ", ".join(repr(name) for name in POLICY_NAMES)


def _check_policy_name(name, argument: str) -> None:
    if not isinstance(name, str):
        raise TypeError(
            f"'{argument}' must be a policy name (a string), one of "
            f"{_VALID_NAMES_TEXT}. Received: {argument}={name!r} of type "
            f"{type(name).__name__}"
        )
    if name not in POLICY_NAMES:
        raise ValueError(
            f"'{argument}' must be one of {_VALID_NAMES_TEXT}. "
            f"Received: {argument}={name!r}"
        )


@keras.saving.register_keras_serializable(package="kmp")
class Policy(keras.DTypePolicy):
    """A dtype policy: the dtype a layer computes in and the one it stores in.

    `"mixed_float16"` and `"mixed_bfloat16"` compute in float16 / bfloat16 and
    keep variables in float32; `"float16"`, `"bfloat16"`, `"float32"` and
    `"float64"` use one dtype for both. A `Policy` is an immutable value and a
    Keras `DTypePolicy`, so any layer accepts it as `dtype=`.

    Args:
        name: One of `"float16"`, `"bfloat16"`, `"float32"`, `"float64"`,
            `"mixed_float16"`, `"mixed_bfloat16"`.

    Raises:
        TypeError: `name` is not a string.
        ValueError: `name` is not one of the six policy names.

    Example:

    >>> policy = Policy("mixed_float16")
    >>> policy.compute_dtype, policy.variable_dtype
    ('float16', 'float32')
    >>> policy
    <Policy "mixed_float16">
    """

    def __init__(self, name: str):
        _check_policy_name(name, "name")
        super().__init__(name)

    def __eq__(self, other):
        # A plain Keras float policy of the same name is the same policy.
        if isinstance(other, keras.DTypePolicy):
            return other.quantization_mode is None and other.name == self.name
        return NotImplemented

    def __hash__(self):
        return hash((Policy, self.name))

    @classmethod
    def from_config(cls, config: dict) -> "Policy":
        """Creates a policy from `get_config()`'s output, `{"name": ...}`."""
        if not isinstance(config, dict) or set(config) != {"name"}:
            raise ValueError(
                "'config' must be a dict with the single key 'name', as "
                f"returned by Policy.get_config(). Received: config={config!r}"
            )
        return cls(config["name"])


PolicyLike = Union[str, Policy, keras.DTypePolicy, None]


def _to_policy(
    policy: PolicyLike, argument: str, default: Optional[str] = None
) -> Policy:
    """Validates `policy` (a name, a kmp or Keras policy) into a `Policy`.

    None is allowed only where there is a `default` policy name for it.
    """
    if policy is None and default is not None:
        return Policy(default)
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, keras.DTypePolicy):
        if (
            policy.quantization_mode is not None
            or not isinstance(policy.name, str)
            or policy.name not in POLICY_NAMES
        ):
            raise ValueError(
                f"'{argument}' must be a floating policy, one of "
                f"{_VALID_NAMES_TEXT}. Received: {argument}={policy!r}"
            )
        return Policy(policy.name)
    if isinstance(policy, str):
        _check_policy_name(policy, argument)
        return Policy(policy)
    allowed = "a policy name (a string), a kmp.Policy, a keras.DTypePolicy"
    allowed += f" or None (for {default!r})" if default is not None else ""
    raise TypeError(
        f"'{argument}' must be {allowed}; the names are {_VALID_NAMES_TEXT}. "
        f"Received: {argument}={policy!r} of type {type(policy).__name__}"
    )


# --- The process-wide global policy, shared with Keras -----------------------
#
# Keras looks its global policy up through `dtype_policy()` and sets it through
# `set_dtype_policy()` in keras.src.dtype_policies.dtype_policy (and the public
# aliases in keras.config and keras.mixed_precision). kmp routes both through
# one process-wide value so every thread sees the same policy.

_keras_get_policy = _keras_policy_module.dtype_policy
_keras_set_policy = _keras_policy_module.set_dtype_policy
_lock = threading.Lock()
_process_policy = None  # A Keras DTypePolicy, or None for Keras's default.


def _get_keras_policy():
    """Keras's global policy lookup, made process-wide."""
    policy = _process_policy
    if policy is None:
        return _keras_get_policy()
    return policy


def _set_keras_policy(policy):
    """Keras's global policy setter, made process-wide."""
    global _process_policy
    with _lock:
        _keras_set_policy(policy)  # Keras validates and sets this thread.
        _process_policy = _keras_global_state.get_global_attribute(
            "dtype_policy"
        )


def _install_keras_hooks() -> None:
    import keras.config
    import keras.mixed_precision

    replacements = {
        _keras_get_policy: _get_keras_policy,
        _keras_set_policy: _set_keras_policy,
    }
    for module in (_keras_policy_module, keras.config, keras.mixed_precision):
        for attribute, value in list(vars(module).items()):
            replacement = replacements.get(value) if callable(value) else None
            if replacement is not None:
                setattr(module, attribute, replacement)


_install_keras_hooks()


def set_global_policy(policy: PolicyLike) -> None:
    """Sets the policy of every layer created from now on, in every thread.

    Args:
        policy: A policy name, a `Policy`, or `None` to go back to `"float32"`.

    The first time float16 is chosen on a machine without a GPU of compute
    capability 7.0 or higher, one line is logged (logger `"kmp"`) saying that
    it will be slow there and what to use instead.

    Raises:
        TypeError: `policy` is not a string, a `Policy`, a Keras
            `DTypePolicy` or `None`.
        ValueError: `policy` names no floating policy.

    Example:

    >>> set_global_policy("mixed_bfloat16")
    >>> keras.layers.Dense(4).dtype_policy.name
    'mixed_bfloat16'
    >>> set_global_policy(None)
    >>> global_policy().name
    'float32'
    """
    policy = _to_policy(policy, "policy", default="float32")
    # Keras gets a plain DTypePolicy, so layers that merely follow the global
    # policy save to `.keras` files that load without kmp.
    _set_keras_policy(keras.DTypePolicy(policy.name))
    if policy.compute_dtype == "float16":
        _doctor.warn_if_float16_is_slow()


def global_policy() -> Policy:
    """Returns the current global policy (`Policy("float32")` unless set).

    It is the same policy Keras uses: one set with
    `keras.config.set_dtype_policy` shows here too.

    Raises:
        ValueError: the global policy was set through Keras to something that is
            not a floating policy (a quantized policy, `"int32"`, ...).

    Example:

    >>> global_policy()
    <Policy "float32">
    """
    policy = _get_keras_policy()
    try:
        return _to_policy(policy, "policy")
    except (TypeError, ValueError):
        raise ValueError(
            f"The global dtype policy is {policy!r}, set through Keras, which "
            f"is not a floating policy kmp supports ({_VALID_NAMES_TEXT}). "
            "Call kmp.set_global_policy(...) with one of those names."
        ) from None


def policy_scope(policy: PolicyLike) -> ContextManager[Policy]:
    """Sets the global policy inside a `with` block and restores it after.

    The previous policy comes back when the block exits, also when it raises.
    Scopes nest. Like the global policy, the scope is process-wide.

    Args:
        policy: A policy name, a `Policy`, or `None` for `"float32"`.

    Yields:
        The `Policy` in force inside the block.

    Raises:
        TypeError, ValueError: as `set_global_policy`, when `policy_scope` is
            called (before any `with`), and nothing changes.

    Example:

    >>> with policy_scope("mixed_float16"):
    ...     layer = keras.layers.Dense(2)
    >>> layer.dtype_policy.name, global_policy().name
    ('mixed_float16', 'float32')
    """
    return _policy_scope(_to_policy(policy, "policy", default="float32"))


@contextlib.contextmanager
def _policy_scope(new_policy: Policy) -> Iterator[Policy]:
    global _process_policy
    previous = (
        _process_policy,
        _keras_global_state.get_global_attribute("dtype_policy"),
    )
    set_global_policy(new_policy)
    try:
        yield new_policy
    finally:
        with _lock:
            _process_policy = previous[0]
            _keras_global_state.set_global_attribute(
                "dtype_policy", previous[1]
            )
