"""Optional dependencies: when one is not installed, the ``ImportError`` names the extra that brings it::

    import nvfp4.peft   # without PEFT: MissingExtraError: nvfp4.peft needs PEFT: pip install 'nvfp4[peft]'

:class:`MissingExtraError` is an ``ImportError`` (``except ImportError`` still catches it), chained to the original
error; the command-line tools print its message as their one-line error.
"""

from __future__ import annotations

import importlib.util

__all__ = ["MissingExtraError", "missing_extra"]


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message says which ``pip install '...[extra]'`` brings it."""


def missing_extra(err: ImportError | None, module: str, what: str, needs: str, install: str) -> MissingExtraError:
    """The error to raise (``raise missing_extra(...) from err``) when an import of (or from) ``module`` failed with
    ``err``: ``what`` needs ``needs``; ``install`` is the pip requirement that brings it.

    When ``module`` is there (installed, but it or something it imports is broken), ``err`` is re-raised as it is:
    installing the extra would not help.
    """
    if err is not None and _found(module):
        raise err
    return MissingExtraError(f"{what} needs {needs}: pip install '{install}'", name=module)


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None  # None too where sys.modules[module] is None
    except (ImportError, ValueError):
        return False
