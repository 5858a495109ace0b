"""The kernels of a compiled step: XLA's HLO and TensorFlow's graphs.

`hlo_kernels(text)` reads the text of an optimized HLO module (JAX's
`jitted.lower(...).compile().as_text()`, TensorFlow's
`experimental_get_compiler_ir(...)(stage="optimized_hlo")`) and counts the
instructions of its ENTRY computation that launch work (fusions, copies,
custom calls...: everything but parameters, constants, tuples and the
like), and separately its `conditional` and `while` instructions, whose
branches and bodies are other computations, and the kernels inside them
(the largest branch of each conditional).

`computation_opcodes(text)` gives the opcodes of each computation, a
fusion's kernel among them.

`hlo_copies(text)` counts its buffer copies: the `copy` instructions (and
`copy-start`, the first half of an asynchronous copy; its `copy-done` is
not counted again) of the ENTRY computation and of the computations its
conditionals, while loops and calls run, both branches of a conditional
included. A `copy` inside a fusion is not counted: it changes a layout
within the fused kernel, which writes its output once either way.
Where XLA cannot update a donated buffer in place it copies it, so the
count shows whether a step keeps the in-place update.

`tf_graph_ops(concrete_function)` counts the ops a `tf.function` runs:
those of its graph and of the functions it calls, and separately the ops
inside `If` branches and `While` bodies, which run only when taken.
"""

import collections
import math
import re

# Instructions that launch no kernel of their own.
TRIVIAL_HLO = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "after-all",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "call",  # Its computation's kernels count (`kernels_in_branches`).
}
_OPCODE = re.compile(r"([a-z][a-z0-9_-]*)\(")


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.-]+)\s*(\(.*\))?.*\{\s*$")
_CALLED = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.-]+)"
    r"|false_computation=%?([\w.-]+)|body=%?([\w.-]+)"
    r"|condition=%?([\w.-]+)|to_apply=%?([\w.-]+))"
)


def _computations(text):
    """`({name: [instruction lines]}, entry name)` of an HLO module."""
    computations, entry, name = {}, None, None
    for line in text.splitlines():
        stripped = line.strip()
        if name is None:
            match = _HEADER.match(stripped)
            if match and not stripped.startswith("HloModule"):
                name = match.group(2)
                computations[name] = []
                if match.group(1):
                    entry = name
            continue
        if stripped == "}":
            name = None
        elif stripped:
            computations[name].append(stripped)
    return computations, entry


def _called_names(line):
    """The computations an instruction line names (branches, a loop's body
    and condition, a call's or reduction's `to_apply`)."""
    names = []
    for groups in _CALLED.findall(line):
        for group in groups:
            names += [c.strip().lstrip("%") for c in group.split(",")]
    return [name for name in names if name]


def computation_opcodes(text: str) -> dict:
    """`{computation name: set of its instructions' opcodes}` of an HLO
    module: what each fused computation (a fusion's kernel) computes."""
    computations, _ = _computations(text)
    return {
        name: {hlo_opcode(line) for line in lines} - {None}
        for name, lines in computations.items()
    }


def hlo_opcode(line):
    """The opcode of one HLO instruction line, or None."""
    if " = " not in line:
        return None
    rhs = line.split(" = ", 1)[1]
    match = _OPCODE.search(rhs)
    return match.group(1) if match else None


def _kernels(computations, name, seen=()):
    """Kernels of computation `name`: its own, plus for each conditional
    the largest of its branches' and for each while loop its body's and
    condition's (once: a count per iteration), and a called
    computation's."""
    own, inside = 0, 0
    for line in computations.get(name, []):
        code = hlo_opcode(line)
        if code is None or (code in TRIVIAL_HLO and code != "call"):
            continue
        own += code != "call"
        if code not in ("conditional", "while", "call") or name in seen:
            continue
        called = _called_names(line)
        sizes = [_kernels(computations, c, seen + (name,)) for c in called]
        if sizes:
            inside += max(sizes) if code == "conditional" else sum(sizes)
    return own + inside


def _reached_opcodes(computations, name, seen=()):
    """Opcodes of `name` and of the computations its conditionals, while
    loops and calls run (not fusions' insides)."""
    found = collections.Counter()
    for line in computations.get(name, []):
        code = hlo_opcode(line)
        found[code] += 1
        if code in ("conditional", "while", "call") and name not in seen:
            for called in _called_names(line):
                found += _reached_opcodes(computations, called, seen + (name,))
    return found


_SHAPE = re.compile(r"=\s*\(?[a-z0-9]+\[([0-9,]*)\]")


def hlo_large_copies(text: str, elements: int) -> dict:
    """`{"in_loops": n, "outside": m}`: the buffer copies (as `hlo_copies`
    counts them) of arrays of at least `elements` elements, those inside
    a while loop's body or condition (each runs at every iteration) apart.

    Raises:
        ValueError: the text has no ENTRY computation.
    """
    computations, entry = _computations(text)
    if entry is None:
        raise ValueError("The HLO text has no ENTRY computation.")
    found = {"in_loops": 0, "outside": 0}

    def walk(name, in_loop, seen):
        for line in computations.get(name, []):
            code = hlo_opcode(line)
            shape = _SHAPE.search(line)
            if code in COPY_OPCODES and shape:
                size = math.prod(int(d) for d in shape.group(1).split(",") if d)
                if size >= elements:
                    found["in_loops" if in_loop else "outside"] += 1
            if code in ("conditional", "while", "call") and name not in seen:
                for called in _called_names(line):
                    walk(called, in_loop or code == "while", seen + (name,))

    walk(entry, False, ())
    return found


def hlo_kernels(text: str) -> dict:
    """`{"kernels", "copies", "kernels_in_branches", "conditional",
    "while", "opcodes"}` of the ENTRY computation of an HLO module's text
    (see the module docstring; `copies` is `hlo_copies`; `conditional`
    and `while` also count those inside called computations and
    branches); `kernels_in_branches`: those of
    the largest branch of each conditional, of each while loop's body
    (once) and of called computations.

    Raises:
        ValueError: the text has no ENTRY computation.
    """
    computations, entry = _computations(text)
    if entry is None:
        raise ValueError("The HLO text has no ENTRY computation.")
    opcodes = collections.Counter(
        code
        for code in map(hlo_opcode, computations[entry])
        if code is not None
    )
    kernels = sum(n for code, n in opcodes.items() if code not in TRIVIAL_HLO)
    reached = _reached_opcodes(computations, entry)
    return {
        "kernels": kernels,
        "copies": sum(reached.get(code, 0) for code in COPY_OPCODES),
        "kernels_in_branches": _kernels(computations, entry) - kernels,
        "conditional": reached.get("conditional", 0),
        "while": reached.get("while", 0),
        "opcodes": dict(opcodes.most_common()),
    }


# The opcodes `hlo_copies` counts.
COPY_OPCODES = ("copy", "copy-start")


def hlo_copies(text: str) -> int:
    """The buffer copies of an HLO module's text (see the module
    docstring).

    Raises:
        ValueError: the text has no ENTRY computation.
    """
    computations, entry = _computations(text)
    if entry is None:
        raise ValueError("The HLO text has no ENTRY computation.")
    reached = _reached_opcodes(computations, entry)
    return sum(reached.get(code, 0) for code in COPY_OPCODES)


# Graph nodes that run no kernel.
TRIVIAL_TF = {
    "Placeholder",
    "_Arg",
    "_Retval",
    "NoOp",
    "Identity",
    "IdentityN",
    "Const",
}
_CALLS = {"PartitionedCall", "StatefulPartitionedCall"}
_IFS = {"If", "StatelessIf", "Case", "StatelessCase"}
_WHILES = {"While", "StatelessWhile"}


def _function_attrs(node, names):
    found = []
    for name in names:
        if name in node.attr:
            value = node.attr[name]
            if value.HasField("func"):
                found.append(value.func.name)
            elif value.HasField("list"):
                found.extend(f.name for f in value.list.func)
    return found


def tf_graph_ops(concrete_function) -> dict:
    """`{"ops", "If", "While", "ops_in_branches", "py_functions",
    "op_types"}` of a `tf.function`'s concrete function (see the module
    docstring): `ops` run on every call, `ops_in_branches` only in taken
    `If` branches and `While` bodies."""
    graph_def = concrete_function.graph.as_graph_def()
    library = {
        f.signature.name: list(f.node_def) for f in graph_def.library.function
    }
    counts = collections.Counter()
    types = collections.Counter()

    def walk(nodes, key, depth=0):
        for node in nodes:
            op = node.op
            if op in _CALLS or op in library:
                names = _function_attrs(node, ["f"]) or [op]
                for name in names:
                    walk(library.get(name, []), key, depth + 1)
                continue
            if op in ("PyFunc", "EagerPyFunc", "PyFuncStateless"):
                counts["py_functions"] += 1
            if op in _IFS:
                counts["If"] += 1
                for name in _function_attrs(
                    node, ["then_branch", "else_branch", "branches"]
                ):
                    walk(library.get(name, []), "ops_in_branches", depth + 1)
                continue
            if op in _WHILES:
                counts["While"] += 1
                for name in _function_attrs(node, ["cond", "body"]):
                    walk(library.get(name, []), "ops_in_branches", depth + 1)
                continue
            if op in TRIVIAL_TF:
                continue
            counts[key] += 1
            if key == "ops":
                types[op] += 1

    walk(graph_def.node, "ops")
    return {
        "ops": counts["ops"],
        "If": counts["If"],
        "While": counts["While"],
        "ops_in_branches": counts["ops_in_branches"],
        "py_functions": counts["py_functions"],
        "op_types": dict(types.most_common()),
    }
