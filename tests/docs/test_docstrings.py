"""Every public name's docstring follows one format, and the CLI has help.

The format (Google style, as the docs' napoleon reads it):

- a summary: the first paragraph is one line ending in a period;
- `Args:` naming every parameter (a class: its `__init__`'s);
- `Returns:` (or `Yields:`) for a function or method that returns a value;
- `Raises:` naming each exception its own code raises;
- `Example:` with a runnable `>>>` example (pytest runs it as a doctest),
  for the public functions and classes; the methods and properties of
  public classes need the rest, not an example.

The public names are `docs/_ext/public_api.py`'s, the ones the API pages
document. `KNOWN_EXCEPTIONS` lists the names that do not follow the format
yet: a listed name that does fails too, so the list only shrinks; once it is
empty the check is strict.
"""

import ast
import inspect
import pathlib
import re
import sys
import textwrap

import pytest

from tests.support import backends

backends.require("tensorflow")  # The site documents the TensorFlow build.

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "docs" / "_ext"))
import public_api  # noqa: E402

import kmp_cli  # noqa: E402

# Names whose docstrings do not follow the format yet: none. A name added
# here must be taken off again once its docstring follows the format.
KNOWN_EXCEPTIONS = frozenset()

SECTION = re.compile(
    r"^(Args|Arguments|Returns|Yields|Raises|Example|Examples|Attributes|"
    r"Note|Notes|Warning|Warnings|See Also):\s*$"
)


def _sections(doc: str) -> dict:
    """Section name -> its text, from a cleaned docstring."""
    sections, current = {"": []}, ""
    for line in doc.splitlines():
        match = SECTION.match(line)
        if match:
            current = match.group(1)
            sections[current] = []
        else:
            sections.setdefault(current, []).append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _own_function_ast(function):
    """The function's AST, without nested functions and classes."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source).body[0]

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _NESTED):
                continue
            yield child
            yield from walk(child)

    return list(walk(tree))


def _raised_names(nodes) -> set:
    names = set()
    for node in nodes or ():
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id[0].isupper():
                names.add(exc.id)
            elif isinstance(exc, ast.Attribute):
                names.add(exc.attr)
    return names


def _returns_value(function, nodes) -> bool:
    annotation = inspect.signature(function).return_annotation
    if annotation is not inspect.Signature.empty:
        return annotation not in (None, "None", type(None))
    return any(
        isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom))
        and node.value is not None
        for node in nodes or ()
    )


def _parameters(function) -> list:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    return [
        name
        for name, parameter in signature.parameters.items()
        if name not in ("self", "cls")
        and parameter.kind
        not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    ]


def problems(obj, example: bool) -> list:
    """What `obj`'s docstring lacks; [] when it follows the format."""
    doc = inspect.getdoc(obj) or ""
    if not doc.strip():
        return ["no docstring"]
    found = []
    first_paragraph = doc.strip().split("\n\n")[0]
    if "\n" in first_paragraph or not first_paragraph.endswith("."):
        found.append("summary is not one line ending in a period")
    sections = _sections(doc)
    if inspect.ismodule(obj) or isinstance(obj, property):
        return found
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return found
        function = obj.__init__
        returns = False
    else:
        function = obj
    nodes = _own_function_ast(function)
    if not inspect.isclass(obj):
        returns = _returns_value(function, nodes)
    parameters = _parameters(function)
    arguments = sections.get("Args", sections.get("Arguments"))
    if parameters:
        if arguments is None:
            found.append("no Args section")
        else:
            missing = [
                name
                for name in parameters
                if not re.search(rf"^\s*\*{{0,2}}{name}\b.*:", arguments, re.M)
            ]
            if missing:
                found.append(f"Args does not name {', '.join(missing)}")
    if returns and "Returns" not in sections and "Yields" not in sections:
        found.append("no Returns section")
    raised = _raised_names(nodes)
    if raised:
        text = sections.get("Raises")
        if text is None:
            names = ", ".join(sorted(raised))
            found.append(f"no Raises section (raises {names})")
        else:
            missing = sorted(name for name in raised if name not in text)
            if missing:
                found.append(f"Raises does not name {', '.join(missing)}")
    if example:
        text = sections.get("Example", sections.get("Examples", ""))
        if ">>>" not in text:
            found.append("no Example section with a >>> example")
    return found


def _overrides_keras(cls, attribute: str) -> bool:
    return any(
        attribute in vars(base) and not base.__module__.startswith("kmp")
        for base in cls.__mro__[1:]
    )


def _members(name: str, cls) -> dict:
    """The public methods and properties `cls` and its kmp bases define.

    A kmp class may hold parts of its API in mixins of its own modules
    (`LossScaleOptimizer`'s scaling and state halves): theirs count as its
    own. An override of a Keras method without a docstring of its own is
    Keras's API, documented by Keras (`build`, `variables`): it is left out.
    """
    members = {}
    owners = [c for c in cls.__mro__ if c.__module__.startswith("kmp")]
    for owner in owners:
        for attribute, value in vars(owner).items():
            if attribute.startswith("_") or any(
                attribute in vars(c) for c in owners[: owners.index(owner)]
            ):
                continue  # Private, or overridden by a class before it.
            function = value.fget if isinstance(value, property) else value
            function = getattr(function, "__func__", function)
            module = getattr(function, "__module__", "") or ""
            if not (function.__doc__ or "").strip() and _overrides_keras(
                cls, attribute
            ):
                continue
            if callable(function) and module.startswith("kmp"):
                members[f"{name}.{attribute}"] = (
                    value if isinstance(value, property) else function
                )
    return members


def all_problems() -> dict:
    """Every public name, method and property -> its problems."""
    report, seen = {}, set()
    for name, obj in public_api.public_names().items():
        if id(obj) in seen:  # A re-export (kmp.mixed_precision.Policy).
            continue
        seen.add(id(obj))
        module_like = inspect.ismodule(obj)
        report[name] = problems(obj, example=not module_like)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for member, value in _members(name, obj).items():
                report[member] = problems(value, example=False)
    return report


REPORT = all_problems()


@pytest.mark.parametrize(
    "name", sorted(name for name in REPORT if name not in KNOWN_EXCEPTIONS)
)
def test_docstring_follows_the_format(name):
    assert REPORT[name] == [], f"{name}: {'; '.join(REPORT[name])}"


@pytest.mark.parametrize("name", sorted(KNOWN_EXCEPTIONS))
def test_known_exception_still_needs_its_place_on_the_list(name):
    assert name in REPORT, f"{name} is no public name: take it off the list"
    assert REPORT[name], f"{name} follows the format: take it off the list"


# Public names of methods kmp's modules call on each other, left off the
# API pages (their docstrings follow the format all the same).
INTERNAL_MEMBERS = frozenset(
    "kmp.LossScaleOptimizer." + name
    for name in (
        "update_state",
        "persistent_skips_message",
        "report_persistent_skips",
        "report_persistent_skips_now",
        "state_variables",
        "check_restored_state",
    )
)


def _listed_members(page: str, name: str) -> set:
    """The names an `autoclass` of `name` on `page` lists in `:members:`."""
    text = (pathlib.Path(__file__).parents[2] / "docs" / page).read_text()
    block = re.search(
        rf"\.\. autoclass:: {re.escape(name)}\n((?:   .*\n)+)", text
    )
    assert block, f"no autoclass of {name} on {page}"
    options = re.search(r":members:(.*?)(?=\n   :|\Z)", block[1], re.S)
    assert options, f"the autoclass of {name} lists no :members:"
    return {f"{name}.{m.strip()}" for m in options[1].split(",") if m.strip()}


def test_api_page_lists_the_members_mixins_define():
    # Sphinx's `:members:` documents what a class defines itself, not what
    # its mixins do (`LossScaleOptimizer`'s scaling and state halves): the
    # page lists the members, and the list is complete.
    name = "kmp.LossScaleOptimizer"
    members = set(_members(name, public_api.public_names()[name]))
    assert _listed_members("api/kmp.md", name) == members - INTERNAL_MEMBERS
    assert INTERNAL_MEMBERS <= members


def test_format_check_catches_what_it_names():
    def documented(a, b):
        """Adds.

        Args:
            a: One.
            b: Two.

        Returns:
            The sum.

        Raises:
            ValueError: Never.

        Example:

        >>> documented(1, 2)
        3
        """
        if a is None:
            raise ValueError("a")
        return a + b

    def bare(a):
        """Adds
        badly."""
        if a is None:
            raise TypeError("a")
        return a

    assert problems(documented, example=True) == []
    assert problems(bare, example=True) == [
        "summary is not one line ending in a period",
        "no Args section",
        "no Returns section",
        "no Raises section (raises TypeError)",
        "no Example section with a >>> example",
    ]


def _actions(parser, prefix="kmp"):
    """(command, action) for every option of `parser` and its subcommands."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from _actions(subparser, f"{prefix} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield prefix, action


def test_every_command_and_option_of_the_cli_has_help():
    import argparse

    parser = kmp_cli.build_parser()
    missing = [
        f"{command} {'/'.join(action.option_strings) or action.dest}"
        for command, action in _actions(parser)
        if not action.help or action.help == argparse.SUPPRESS
    ]
    subparsers = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    )
    missing += [
        f"kmp {name} (no description)"
        for name, sub in subparsers.choices.items()
        if not sub.description
    ]
    assert missing == []
