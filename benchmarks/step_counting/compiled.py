"""The kernels of a compiled step: XLA's HLO and TensorFlow's graphs.

`hlo_kernels(text)` reads the text of an optimized HLO module (JAX's
`jitted.lower(...).compile().as_text()`, TensorFlow's
`experimental_get_compiler_ir(...)(stage="optimized_hlo")`) and counts the
instructions of its ENTRY computation that launch work (fusions, copies,
custom calls...: everything but parameters, constants, tuples and the
like), and separately its `conditional` and `while` instructions, whose
branches and bodies are other computations.

`tf_graph_ops(concrete_function)` counts the ops a `tf.function` runs:
those of its graph and of the functions it calls, and separately the ops
inside `If` branches and `While` bodies, which run only when taken.
"""

import collections
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
}
_OPCODE = re.compile(r"([a-z][a-z0-9_-]*)\(")


def _entry_lines(text):
    lines = text.splitlines()
    inside = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("ENTRY "):
            inside = True
            continue
        if inside:
            if stripped == "}":
                return
            yield stripped


def hlo_opcode(line):
    """The opcode of one HLO instruction line, or None."""
    if " = " not in line:
        return None
    rhs = line.split(" = ", 1)[1]
    match = _OPCODE.search(rhs)
    return match.group(1) if match else None


def hlo_kernels(text: str) -> dict:
    """`{"kernels", "conditional", "while", "opcodes"}` of the ENTRY
    computation of an HLO module's text (see the module docstring).

    Raises:
        ValueError: the text has no ENTRY computation.
    """
    if "ENTRY " not in text:
        raise ValueError("The HLO text has no ENTRY computation.")
    opcodes = collections.Counter(
        code for code in map(hlo_opcode, _entry_lines(text)) if code is not None
    )
    kernels = sum(n for code, n in opcodes.items() if code not in TRIVIAL_HLO)
    return {
        "kernels": kernels,
        "conditional": opcodes.get("conditional", 0),
        "while": opcodes.get("while", 0),
        "opcodes": dict(opcodes.most_common()),
    }


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
