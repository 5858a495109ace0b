"""No import cycle anywhere in kmp, and the layers `lint-imports` checks.

The cycle check reads every module of `kmp/` and `kmp_cli/` with `ast`:
every `import` and `from ... import` (at the top, under an `if`, or inside
a function) is an edge, and so is a string `"kmp...."` passed to
`importlib.import_module`. A strongly connected set of two or more modules
is a cycle. A package's `__init__` importing its own submodules, and a
submodule importing names from its package, are left out: Python runs the
package first, so they are not cycles of the code's layers.
"""

import ast
import configparser
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kmp", "kmp_cli")

# The same on every backend: CI runs it on TensorFlow only.
pytestmark = pytest.mark.anybackend


def module_names(root):
    """{dotted name: path} of every module of PACKAGES under `root`."""
    names = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def _target(name, modules):
    """The module `name` refers to: itself, else its nearest package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name, path, modules):
    """The modules of `modules` that module `name` (at `path`) imports."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets.append(base)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"kmp(_cli)?(\.\w+)+", node.value)
        ):
            targets = [node.value]
        for target in targets:
            module = _target(target, modules)
            if module is None or module == name:
                continue
            # A package and its own submodules: not a cycle of layers.
            if module.startswith(name + ".") or name.startswith(module + "."):
                continue
            found.add(module)
    return found


def cycles(root):
    """The strongly connected sets of two or more modules (Tarjan)."""
    modules = module_names(root)
    graph = {n: imports_of(n, p, modules) for n, p in modules.items()}
    index, low, stack, on_stack, result = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return result


def test_no_import_cycle_in_kmp():
    assert cycles(ROOT) == []


def test_a_cycle_is_found(tmp_path):
    """The check finds a cycle through a function-local import and one
    through `importlib.import_module`."""
    core = tmp_path / "kmp" / "core"
    core.mkdir(parents=True)
    (tmp_path / "kmp" / "__init__.py").write_text("")
    (tmp_path / "kmp_cli").mkdir()
    (tmp_path / "kmp_cli" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "a.py").write_text("from kmp.core import b\n")
    (core / "b.py").write_text(
        "def f():\n    from kmp.core.a import g\n    return g\n"
    )
    (core / "c.py").write_text("import kmp.core.d\n")
    (core / "d.py").write_text(
        "import importlib\n\nTABLE = {'x': 'kmp.core.c'}\n"
        "importlib.import_module(TABLE['x'])\n"
    )
    assert cycles(tmp_path) == [
        ["kmp.core.a", "kmp.core.b"],
        ["kmp.core.c", "kmp.core.d"],
    ]


def test_the_layer_contracts_name_modules_that_exist():
    """`lint-imports` (run in CI) checks the contracts in setup.cfg; a
    contract that names a module no longer there would check nothing."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    modules = module_names(ROOT)
    named = []
    for section in config.sections():
        if not section.startswith("importlinter:contract:"):
            continue
        contract = config[section]
        containers = contract.get("containers", "").split()
        for key in ("layers", "modules"):
            for line in contract.get(key, "").split("\n"):
                for part in line.split("|"):
                    part = part.strip()
                    if not part:
                        continue
                    named += [f"{c}.{part}" for c in containers] or [part]
    assert named
    assert [name for name in named if name not in modules] == []


def test_kmp_core_imports_kmp_only_at_the_top():
    """A function-local import of kmp's own code dodges a cycle, and inside
    a function that TensorFlow's AutoGraph converts it makes AutoGraph warn
    ("could not transform <function _gcd_import>"). Function-local imports
    are for optional third-party packages only."""
    local = []
    for name, path in module_names(ROOT).items():
        if not name.startswith("kmp.core"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if not isinstance(
                function, (ast.FunctionDef, ast.AsyncFunctionDef)
            ):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (
                    node.level or (node.module or "").startswith("kmp")
                ):
                    local.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                elif isinstance(node, ast.Import) and any(
                    a.name.startswith("kmp") for a in node.names
                ):
                    local.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert local == []
