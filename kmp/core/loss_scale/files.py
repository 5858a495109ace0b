"""Saving and restoring a `LossScaleOptimizer`'s state: `.keras` files and
`tf.train.Checkpoint`s.

Everything restored is checked before any of it is assigned: a scale that
is not finite, outside [min_scale, max_scale], or not the fixed scale of a
fixed optimizer, or a count out of its range, raises `ValueError`, and the
optimizer stays as it was.

An optimizer that `model.compile` made by itself (`keras_file_layout`)
writes Keras's variables and the inner optimizer's where Keras's own
`LossScaleOptimizer` writes them, so that Keras without kmp loads the file,
scale included; kmp's counts go to a group of their own
(`optimizer/_kmp_state`, a `KmpFileState`), which Keras without kmp never
reads and kmp restores with the rest, checked with it: if they are refused,
the scale and counter just read are put back too. In a checkpoint the
optimizer looks like its inner one plus the loss-scale state
(`kmp.core.tensorflow.checkpoint`).
"""

import warnings

import numpy as np
from keras import ops
from keras.src.saving.keras_saveable import KerasSaveable


class FilesMixin:
    """The saving-and-restoring half of `LossScaleOptimizer`'s state (see
    the module docstring); the variables are `kmp.core.loss_scale.state`'s."""

    def _file_state(self):
        """The group of a Keras-layout `.keras` file that holds kmp's own
        counts (made with the state's variables)."""
        return KmpFileState(self._save_kmp_variables, self._load_kmp_variables)

    def _file_variables(self):
        if self.keras_file_layout:
            return self._keras_variables() + self._inner_optimizer.variables
        return self.variables

    def _kmp_variables(self):
        """kmp's own variables, which Keras's layout keeps apart."""
        return self._variables[len(self._keras_variables()) :]

    def save_own_variables(self, store):
        for index, variable in enumerate(self._file_variables()):
            store[str(index)] = ops.convert_to_numpy(variable)

    def load_own_variables(self, store):
        # Set below once Keras's part of a Keras-layout file is restored.
        self.__dict__.pop("_before_kmp_load", None)
        variables = self._file_variables()
        if len(store.keys()) != len(variables):
            warnings.warn(
                f"Skipping variable loading for optimizer '{self.name}', "
                f"because it has {len(variables)} variables whereas the "
                f"saved optimizer has {len(store.keys())} variables.",
                stacklevel=2,
            )
            return
        values = [np.asarray(store[str(i)]) for i in range(len(variables))]
        self._check_file_values(variables, values)
        if self.keras_file_layout:
            # Put back if kmp's part of the file is refused. (Not set as an
            # attribute: Keras would track the variables in it.)
            self.__dict__["_before_kmp_load"] = [
                (variable, np.array(ops.convert_to_numpy(variable)))
                for variable in self.state_variables().values()
            ]
        for variable, value in zip(variables, values):
            variable.assign(value)

    def _check_file_values(self, variables, values):
        """Raises ValueError unless `values` fit `variables` (shapes) and
        the loss-scale state among them is valid."""
        for variable, value in zip(variables, values):
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(
                    f"The .keras file has a value of shape {value.shape} for "
                    f"the optimizer variable '{variable.path}' of shape "
                    f"{tuple(variable.shape)}. Nothing was restored."
                )
        by_variable = {id(v): value for v, value in zip(variables, values)}
        self.check_restored_state(
            {
                name: by_variable[id(variable)]
                for name, variable in self.state_variables().items()
                if id(variable) in by_variable
            },
            "the .keras file",
        )

    def _save_kmp_variables(self, store):
        if self.keras_file_layout:
            for variable in self._kmp_variables():
                store[variable.name] = ops.convert_to_numpy(variable)

    def _load_kmp_variables(self, store):
        # Keras loads this right after the optimizer's own store; without
        # Keras's part restored (refused, or not this layout) it is left.
        before = self.__dict__.pop("_before_kmp_load", None)
        saved = set(store.keys())
        if before is None or not saved:
            return  # Not saved: a file of Keras, or of an older kmp.
        variables = [v for v in self._kmp_variables() if v.name in saved]
        values = [np.asarray(store[v.name]) for v in variables]
        try:
            self._check_file_values(variables, values)
        except ValueError:
            for variable, value in before:
                variable.assign(value)
            raise
        for variable, value in zip(variables, values):
            variable.assign(value)

    def state_variables(self) -> dict:
        """The loss-scale state by name, as saved in checkpoints.

        Returns:
            A dict of name -> variable.
        """
        return {
            "scale": self.dynamic_scale,
            "counter": self.step_counter,
            "skipped_steps": self.skipped_steps_variable,
            "consecutive_skips": self.consecutive_skips_variable,
            "hysteresis_left": self.hysteresis_left,
        }

    def check_restored_state(self, values: dict, source: str) -> None:
        """Raises ValueError if restored `values` break an invariant.

        Args:
            values: name -> NumPy value, for the names of `state_variables`
                present in what is restored.
            source: Where they come from, for the message.

        Raises:
            ValueError: a value breaks an invariant; nothing is assigned.
        """
        where = f"The loss-scale state restored from {source}"
        for name, value in values.items():
            value = np.asarray(value)
            if value.shape != () or value.dtype.kind not in "biuf":
                raise ValueError(
                    f"{where} has {name}={_plain(value)!r} ({value.dtype}, "
                    f"shape {value.shape}); it must be a single number. "
                    "Nothing was restored."
                )
        if "scale" in values:
            # As the float32 the scale variable will hold, compared with the
            # settings, which are float32 values too (checks.checked_float).
            with np.errstate(over="ignore", invalid="ignore"):
                scale = float(np.asarray(values["scale"]).astype(np.float32))
            if self._dynamic:
                low, high = self._rule.min_scale, self._rule.max_scale
                if not low <= scale <= high:
                    raise ValueError(
                        f"{where} has a scale of {_plain(values['scale'])!r}; "
                        "it must be a finite number in [min_scale, "
                        f"max_scale] = [{low:g}, {high:.6g}]. Nothing was "
                        "restored."
                    )
            elif scale != self._initial_scale:
                raise ValueError(
                    f"{where} has a scale of {_plain(values['scale'])!r}, "
                    "but this optimizer's scale is fixed at "
                    f"{self._initial_scale:.9g} "
                    "(dynamic=False): restoring would silently replace it. "
                    "Create the optimizer as the saved one was (dynamic=True "
                    "for a dynamic scale), or restore into a fresh one. "
                    "Nothing was restored."
                )
        limits = {
            "counter": (
                self._rule.growth_steps - 1 if self._dynamic else 0,
                "a count of finite steps below dynamic_growth_steps",
            ),
            "skipped_steps": (None, "a count >= 0"),
            "consecutive_skips": (None, "a count >= 0"),
            "hysteresis_left": (
                self._rule.hysteresis if self._dynamic else 1,
                "a count in [1, hysteresis]",
            ),
        }
        for name, (high, allowed) in limits.items():
            if name not in values:
                continue
            value = values[name]
            low = 1 if name == "hysteresis_left" else 0
            number = int(value) if np.isfinite(value) else None
            if (
                number is None
                or number < low
                or (high is not None and number > high)
            ):
                raise ValueError(
                    f"{where} has {name}={_plain(value)!r}; it must be "
                    f"{allowed}. "
                    "Nothing was restored."
                )

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # In a tf.train.Checkpoint this optimizer looks like its inner one
        # plus the loss-scale state, so checkpoints carry over between a
        # plain and a loss-scale optimizer, both ways.
        children = self._backend_step.checkpoint_children(self, save_type)
        children.update(
            self._inner_optimizer._trackable_children(save_type, **kwargs)
        )
        return children


class KmpFileState(KerasSaveable):
    """kmp's counts in a Keras-layout `.keras` file, at their own path.

    Keras's saving walks an optimizer's attributes and gives each
    `KerasSaveable` its own store, after the optimizer's own; Keras's own
    `LossScaleOptimizer` has no such attribute, so Keras without kmp loads
    the file and leaves this group unread.
    """

    def __init__(self, save, load):
        # Functions, not the optimizer: Keras would walk into it again.
        self._save = save
        self._load = load

    def _obj_type(self):
        return "Optimizer"

    def save_own_variables(self, store):
        self._save(store)

    def load_own_variables(self, store):
        self._load(store)


def _plain(value):
    """A restored NumPy value as a Python number, for messages."""
    value = np.asarray(value)
    return value.item() if value.size == 1 else value.tolist()
