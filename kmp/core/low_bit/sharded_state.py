"""Optimizer state split over the data-parallel devices
(`kmp.LowPrecisionOptimizer(..., shard_state=True)`; ZeRO stage 1).

Under `keras.distribution.DataParallel` every device holds the whole model
and, with Keras's optimizers, the whole optimizer state. With
`shard_state=True` each variable's state (the inner optimizer's slots, kmp's
quantized codes and block scales, the Kahan compensation buffers) is laid
out over the data axis of the distribution's mesh (its `batch_dim_name`)
on one of the variable's axes: each device keeps and updates 1/N of it,
the weights stay as the distribution lays them out, and XLA, which
partitions the compiled step from the variables' layouts, updates each
shard where it lies and gathers the updated weights (as MaxText's
`shard_optimizer_over_data` does). Under `ModelParallel` the data axis is
added beside the model axes of the variable's layout: on a 2-D mesh each
device holds 1/(data x model) of a sharded variable's state.

Which axis (`Split.axes`): the first axis of the variable that its
layout leaves whole and whose length the data axis's devices divide;
for quantized slots (`Split.quantized_axes`), one on which the codes and,
where possible, the block scales divide too (else the scales of that axis
stay on every device of the data axis, as under `ModelParallel`:
`kmp.core.low_bit.slots.layouts`). Variables of fewer than
`MIN_SHARDED_SIZE` elements keep their state as the variable is laid out
(biases, normalization scales: little memory, and a gather each). A larger
variable none of whose free axes divides is refused at build, naming it,
its shape and the mesh: its state would otherwise stay whole on every
device, unnoticed.
"""

import dataclasses
import math

import keras

# Variables smaller than this (in elements) keep their state whole: under
# 16 KB of float32 per slot, where splitting saves little and adds a gather
# of the variable to each step.
MIN_SHARDED_SIZE = 4096


def axes_of(layout):
    """A layout's mesh axis per variable axis (None: not a known layout)."""
    if layout is None:
        return None
    axes = getattr(layout, "axes", None)
    if axes is None:
        axes = getattr(layout, "spec", None)
    return None if axes is None else tuple(axes)


def mesh_sizes(layout) -> dict:
    """`{mesh axis: devices}` of a layout's mesh (a `TensorLayout`'s, or
    the distribution's where it has none yet; a JAX sharding's)."""
    if isinstance(layout, keras.distribution.TensorLayout):
        mesh = layout.device_mesh
        if mesh is None:  # Given the distribution's when it is used.
            mesh = keras.distribution.distribution().device_mesh
        return dict(zip(mesh.axis_names, mesh.shape))
    return dict(layout.mesh.shape)  # A JAX NamedSharding.


def split_of_distribution(storage_of=None):
    """The `Split` of the distribution in effect (`storage_of`: see
    `Split`), or None where there is none or its data axis has one device
    (nothing to split)."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    axis = distribution.batch_dim_name
    if sizes.get(axis, 1) == 1:
        return None
    if storage_of is None:
        return Split(axis, sizes[axis], mesh)
    return Split(axis, sizes[axis], mesh, storage_of)


@dataclasses.dataclass(frozen=True)
class Split:
    """The state split over mesh axis `axis` (`devices` long) of `mesh`
    (a `keras.distribution.DeviceMesh`)."""

    axis: str
    devices: int
    mesh: object
    # `variable` -> how its quantized slots are kept: None (not quantized),
    # `("shaped", Storage)` or `("flat", blocks)`.
    storage_of: object = lambda variable: None

    def _own(self, variable):
        """The mesh axes the variable's own layout gives its axes."""
        axes = axes_of(getattr(variable, "_layout", None))
        if axes is None:
            return (None,) * len(tuple(variable.shape))
        return axes

    def _uses_axis(self, axes) -> bool:
        for axis in axes:
            names = axis if isinstance(axis, (tuple, list)) else (axis,)
            if self.axis in names:
                return True
        return False

    def _kept(self, variable) -> bool:
        """Whether the variable's state stays laid out as the variable:
        small, or already split over the data axis by its own layout."""
        shape = tuple(variable.shape)
        if math.prod(shape) < MIN_SHARDED_SIZE:
            return True
        return self._uses_axis(self._own(variable))

    def axes(self, variable):
        """The mesh axes of `variable`'s state shaped like it (its plain
        slots, its compensation, its quantized codes where they keep its
        shape): its layout's, with the data axis on the first axis that
        layout leaves whole and the devices divide (where its slots are
        quantized, one where the codes and block scales divide, else the
        codes: `quantized_axes`); None where the state keeps the
        variable's layout.

        Raises:
            ValueError: no axis of a large variable divides.
        """
        if self._kept(variable):
            return None
        found = self.storage_of(variable)
        if found is not None and found[0] == "shaped":
            return self.quantized_axes(variable, found[1])
        own = self._own(variable)
        shape = tuple(variable.shape)
        for index, (length, axis) in enumerate(zip(shape, own)):
            if axis is None and length % self.devices == 0:
                return self._with_axis(own, index)
        self._refuse(variable)

    def quantized_axes(self, variable, storage):
        """`axes` of a variable whose quantized slots are kept in
        `storage` (a `kmp.core.low_bit.quantization.Storage`).

        Raises:
            ValueError: no axis of a large variable divides its codes.
        """
        own = self._own(variable)
        codes_only = None
        for index, axis in enumerate(own):
            if axis is not None or storage.codes[index] % self.devices:
                continue
            if storage.scales[index] % self.devices == 0:
                return self._with_axis(own, index)
            if codes_only is None:
                codes_only = index
        if codes_only is not None:
            return self._with_axis(own, codes_only)
        whole = tuple(n for n, a in zip(storage.codes, own) if a is None)
        self._refuse(
            variable,
            f"none of the axes its layout {own} leaves whole is a multiple "
            f"of {self.devices} in its quantized codes, {whole}",
            "; or pass another block_size, or keep its slots unquantized "
            "(exclude_from_8bit)",
        )

    def flat_axes(self, variable, blocks: int):
        """The mesh axes of a quantized slot's flat codes and scales
        (`blocks` blocks): the data axis where the devices divide the
        blocks (each holds whole ones); None where the state keeps the
        variable's layout.

        Raises:
            ValueError: the devices do not divide the blocks of a large
                variable.
        """
        if self._kept(variable):
            return None
        if blocks % self.devices == 0:
            return (self.axis,)
        self._refuse(
            variable,
            f"its quantized slots are kept flat (their blocks do not tile "
            f"its rows), in {blocks} blocks, not a multiple of "
            f"{self.devices}",
            "; or pass a block_size that its last axis is a multiple of, "
            "or keep its slots unquantized (exclude_from_8bit)",
        )

    def check(self, variables) -> None:
        """Refuses, before anything is built, a variable whose state
        cannot be split."""
        for variable in variables:
            self.axes(variable)
            found = self.storage_of(variable)
            if found is not None and found[0] == "flat":
                self.flat_axes(variable, found[1])

    def layout(self, axes):
        """A `TensorLayout` of `axes` on the mesh."""
        return keras.distribution.TensorLayout(axes, self.mesh)

    def _with_axis(self, own, index):
        axes = list(own)
        axes[index] = self.axis
        return tuple(axes)

    def _refuse(self, variable, why=None, fix=""):
        """Raises the error for a state that cannot be split: `why` (by
        default, no whole axis of the variable divides)."""
        shape = tuple(variable.shape)
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape))
        own = self._own(variable)
        if why is None:
            free = tuple(n for n, a in zip(shape, own) if a is None)
            why = (
                f"none of the axes its layout {own} leaves whole, {free}, "
                f"is a multiple of {self.devices}"
            )
        raise ValueError(
            f"shard_state=True cannot split the optimizer state of "
            f"{variable.path!r} (shape {shape}) over the {self.devices} "
            f"devices of mesh axis {self.axis!r} (mesh {sizes}): {why}. "
            f"Pad an axis to a multiple of {self.devices} (as vocabularies "
            f"are padded to multiples of 128), or use a mesh whose "
            f"{self.axis!r} axis divides one{fix}."
        )


class LaidOut:
    """`variable`, but with `layout`: what a builder of state from a
    reference variable (Keras's `add_variable_from_reference`) is given so
    that it names and shapes the state as the variable's, laid out as the
    state is."""

    def __init__(self, variable, layout):
        self._variable = variable
        self._layout = layout

    def __getattr__(self, name):
        return getattr(self._variable, name)


def reference(split, variable, axes=None):
    """`variable`, or a `LaidOut` of it with the state's `axes` (by default
    `split.axes(variable)`) where `split` (a `Split`, or None) lays its
    state out otherwise."""
    if split is None:
        return variable
    if axes is None:
        axes = split.axes(variable)
    if axes is None:
        return variable
    return LaidOut(variable, split.layout(axes))


def plain_builder(split, original):
    """An `add_variable_from_reference` that builds the state shaped like a
    variable through `original` (the inner optimizer's own), laid out by
    `split`."""

    def add_variable_from_reference(
        reference_variable, name=None, initializer="zeros"
    ):
        laid_out = reference(split, reference_variable)
        return original(laid_out, name, initializer)

    return add_variable_from_reference


__all__ = [
    "LaidOut",
    "MIN_SHARDED_SIZE",
    "Split",
    "axes_of",
    "mesh_sizes",
    "plain_builder",
    "reference",
    "split_of_distribution",
]
