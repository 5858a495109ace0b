"""The passes a compiled step makes over each gradient: XLA's HLO, counted.

`gradient_passes(text, parameters)` reads the text of an optimized HLO
module whose ENTRY computation takes the gradients as parameters (JAX's
`jax.jit(step).lower(..., grads, ...).compile().as_text()`, the step given
the gradients) and counts, for each of those parameters, the kernels of an
applied step that read the gradient, or a copy of it a kernel wrote out:
a value of the gradient's shape computed from it and scalars alone (the
unscaled gradient `g / scale`, a cast). A kernel is any instruction that
launches work (`compiled.TRIVIAL_HLO` do not); a fusion counts once, however
often it reads the value. Through a conditional, the values go into each
branch and the largest count of the branches is taken (the applied step's);
through a `call`, into its computation. A fused multiply read by two
fusions counts twice: each fusion reads the gradient once.

Plain Adam, jitted on the gradients, reads each one in the fusion that
updates the first moment and the one that updates the second: 2 passes.
A check for inf/NaN that reads the gradient adds one; an unscaled copy
written out adds the pass that writes it and one more for the check that
reads the copy rather than the gradient.

    >>> text = '''
    ... ENTRY %main (g: f32[8], s: f32[]) -> f32[8] {
    ...   %g = f32[8]{0} parameter(0)
    ...   %s = f32[] parameter(1)
    ...   %d = f32[8]{0} fusion(%g, %s), kind=kLoop, calls=%f
    ...   %r = pred[] fusion(%d), kind=kLoop, calls=%f2
    ...   ROOT %u = f32[8]{0} fusion(%d, %r), kind=kLoop, calls=%f3
    ... }
    ... '''
    >>> gradient_passes(text, [0])
    [3]
"""

import re

from . import compiled

_INSTRUCTION = re.compile(
    r"^(?:ROOT\s+)?%?([\w.-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9_-]*)\((.*)$"
)
_OPERAND = re.compile(r"%([\w.-]+)")
_INDEX = re.compile(r"index=(\d+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE = re.compile(r"true_computation=%?([\w.-]+)")
_FALSE = re.compile(r"false_computation=%?([\w.-]+)")
_TO_APPLY = re.compile(r"to_apply=%?([\w.-]+)")
_LAYOUT = re.compile(r"\{[^}]*\}")
# Instructions that pass a value on, unchanged, without a kernel.
_FORWARDING = {"bitcast", "reshape", "opt-barrier"}


def _parse(line):
    """`(name, shape, opcode, operands, rest)` of an instruction line, or
    None. `operands` are the names inside the opcode's parentheses."""
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    name, shape, opcode, tail = match.groups()
    depth, end = 1, len(tail)
    for position, char in enumerate(tail):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            end = position
            break
    operands = _OPERAND.findall(tail[:end])
    return name, _LAYOUT.sub("", shape).strip(), opcode, operands, tail[end:]


def _called(opcode, rest):
    """The computations a conditional's branches or a call run."""
    if opcode == "conditional":
        found = _BRANCHES.search(rest)
        if found:
            return [c.strip().lstrip("%") for c in found.group(1).split(",")]
        return [m.group(1) for m in (_TRUE.search(rest), _FALSE.search(rest))]
    found = _TO_APPLY.search(rest)
    return [found.group(1)] if found else []


class _Counter:
    def __init__(self, text):
        self.computations, self.entry = compiled._computations(text)
        if self.entry is None:
            raise ValueError("The HLO text has no ENTRY computation.")

    def walk(self, name, bindings, shapes):
        """Passes per gradient in computation `name`, whose parameter `i`
        carries `bindings[i]`: a gradient's index, a tuple of those (or
        None), or None."""
        values, passes, sizes = {}, {}, {}
        for line in self.computations.get(name, []):
            parsed = _parse(line)
            if parsed is None:
                continue
            out, shape, opcode, operands, rest = parsed
            sizes[out] = shape
            tags = [values.get(o) for o in operands]
            if opcode == "parameter":
                number = int(re.search(r"parameter\((\d+)\)", line).group(1))
                values[out] = bindings.get(number)
            elif opcode == "get-tuple-element":
                tag = tags[0] if tags else None
                index = int(_INDEX.search(rest).group(1))
                values[out] = tag[index] if isinstance(tag, tuple) else None
            elif opcode == "tuple":
                values[out] = tuple(tags)
            elif opcode in _FORWARDING:
                values[out] = tags[0] if tags else None
            elif opcode in ("conditional", "call"):
                first = 1 if opcode == "conditional" else 0
                called = _called(opcode, rest)
                counts = []
                for position, computation in enumerate(called):
                    if opcode == "conditional":
                        binding = {0: tags[first + position]}
                    else:
                        binding = dict(enumerate(tags))
                    counts.append(self.walk(computation, binding, shapes))
                for gradient in set().union(*counts) if counts else ():
                    passes[gradient] = passes.get(gradient, 0) + max(
                        c.get(gradient, 0) for c in counts
                    )
                values[out] = None
            elif opcode in compiled.TRIVIAL_HLO:
                values[out] = None
            else:
                read = {t for t in tags if isinstance(t, int)}
                for gradient in read:
                    passes[gradient] = passes.get(gradient, 0) + 1
                values[out] = _derived(
                    read, tags, operands, shape, shapes, sizes
                )
        return passes


def _derived(read, tags, operands, shape, shapes, sizes):
    """The gradient a kernel's output is a copy of (of its shape, made
    from it and scalars alone), or None."""
    if len(read) != 1:
        return None
    (gradient,) = read
    if shape != shapes[gradient] or shape.endswith("[]"):
        return None
    others = [o for o, t in zip(operands, tags) if t != gradient]
    if any(not sizes.get(o, "").endswith("[]") for o in others):
        return None
    return gradient


def named_parameters(text: str, names) -> list:
    """The ENTRY parameter numbers of the arguments JAX named `names` (its
    `op_name` metadata: `"g[0]"` for the first leaf of argument `g`).
    JAX passes large constants a function closes over (kmp's code
    tables) as parameters before the function's own arguments, so an
    argument's number is not its place in the call.

    >>> text = '''
    ... ENTRY %main (a: u8[9], g: f32[8]) -> f32[8] {
    ...   %a = u8[9]{0} parameter(0)
    ...   %g = f32[8]{0} parameter(1), metadata={op_name="g[0]"}
    ...   ROOT %n = f32[8]{0} negate(%g)
    ... }'''
    >>> named_parameters(text, ["g[0]"])
    [1]

    Raises:
        ValueError: a name is not one of the ENTRY computation's.
    """
    entry = text[text.index("ENTRY") :]
    pattern = r'parameter\((\d+)\)[^\n]*op_name="([^"]+)"'
    found = {name: int(n) for n, name in re.findall(pattern, entry)}
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(f"No ENTRY parameters named {missing}.")
    return [found[name] for name in names]


def gradient_passes(text: str, parameters) -> list:
    """The passes over each gradient (see the module docstring), one count
    per ENTRY parameter number in `parameters`, in their order.

    Raises:
        ValueError: the text has no ENTRY computation, or a number is not
            one of its parameters.
    """
    counter = _Counter(text)
    shapes = {}
    for line in counter.computations[counter.entry]:
        parsed = _parse(line)
        if parsed is not None and parsed[2] == "parameter":
            number = int(re.search(r"parameter\((\d+)\)", line).group(1))
            shapes[number] = parsed[1]
    parameters = list(parameters)
    missing = [p for p in parameters if p not in shapes]
    if missing:
        raise ValueError(
            f"Not parameters of the ENTRY computation: {missing} (it has "
            f"{len(shapes)})."
        )
    bindings = {p: p for p in parameters}
    passes = counter.walk(counter.entry, bindings, shapes)
    return [passes.get(p, 0) for p in parameters]
