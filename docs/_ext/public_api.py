"""kmp's public names: what the API pages must document, in one place.

Used by the docs build (`kmp_docs.py`: each must have a docstring and an
API entry) and by `tests/docs/test_docstrings.py` (their format).
"""

from typing import Dict

# Modules whose `__all__` is public beside `kmp.__all__`.
MODULES = ("kmp.mixed_precision", "kmp.callbacks", "kmp.patches")


def public_names() -> Dict[str, object]:
    """Every public name: dotted name -> object.

    `kmp.__all__` (but `__version__`), then each module of `MODULES` by its
    `__all__`. The command line is its parser (`kmp_cli.build_parser`).
    """
    import importlib

    import kmp

    names = {}
    for name in kmp.__all__:
        if name != "__version__":
            names[f"kmp.{name}"] = getattr(kmp, name)
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            names[f"{module_name}.{name}"] = getattr(module, name)
    return names


__all__ = ["MODULES", "public_names"]
