"""Test helper (no pytest import): make every numpy reference stage raise, in this process or in every process
the test starts, to prove that a path runs none of them.

:func:`forbid_reference_stages` replaces the code of every module-level function defined in
``dspark_kernels.reference.*``, and of ``dspark_kernels.model.numerics.rms_norm`` (the layer norms' numpy form),
with code that raises ``AssertionError("numpy reference stage ran ...: <name>")``. Replacing the code object, not a
module attribute, reaches every binding of the function (``from ... import`` names, default arguments, tables).
:data:`SITECUSTOMIZE` is the body of a ``sitecustomize.py`` that does the same at the start of every Python
process whose ``PYTHONPATH`` holds it while ``DSPARK_FORBID_REFERENCE`` is set (TP rank processes and the pypto
kernel children they start); ``DSPARK_FORBID_REFERENCE_SKIP`` lists modules left callable (comma-separated).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import types

#: numpy compute outside ``dspark_kernels.reference`` that only the reference path may run (module, name).
EXTRA_STAGES = (("dspark_kernels.model.numerics", "rms_norm"),)
#: Substring of the error a forbidden stage raises.
MESSAGE = "numpy reference stage ran on a forbidden path"


def _stage_ran(*args: object, **kwargs: object) -> None:
    raise AssertionError("numpy reference stage ran on a forbidden path: "
                         + __import__("sys")._getframe().f_code.co_qualname)


def reference_stage_functions(skip: tuple[str, ...] = ()) -> list[types.FunctionType]:
    """Every module-level function of ``dspark_kernels.reference.*`` (modules in ``skip`` excepted) and the extras."""
    import dspark_kernels.reference as reference

    funcs = []
    for info in pkgutil.iter_modules(reference.__path__):
        name = f"{reference.__name__}.{info.name}"
        if name in skip:
            continue
        module = importlib.import_module(name)
        funcs += [obj for obj in vars(module).values()
                  if inspect.isfunction(obj) and obj.__module__ == name and not obj.__code__.co_freevars]
    funcs += [getattr(importlib.import_module(module), attr) for module, attr in EXTRA_STAGES if module not in skip]
    return funcs


def forbid_reference_stages(skip: tuple[str, ...] = ()) -> list[tuple[types.FunctionType, types.CodeType]]:
    """Make the functions of :func:`reference_stage_functions` raise; returns (function, original code) pairs."""
    saved = []
    for func in reference_stage_functions(skip):
        saved.append((func, func.__code__))
        func.__code__ = _stage_ran.__code__.replace(co_name=func.__name__,
                                                    co_qualname=f"{func.__module__}.{func.__qualname__}")
    return saved


def restore(saved: list[tuple[types.FunctionType, types.CodeType]]) -> None:
    for func, code in saved:
        func.__code__ = code


SITECUSTOMIZE = f'''
import os
if os.environ.get("DSPARK_FORBID_REFERENCE"):
    import importlib.util
    _spec = importlib.util.spec_from_file_location("dspark_reference_guard", {__file__!r})
    _guard = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_guard)
    _guard.forbid_reference_stages(tuple(filter(None, os.environ.get("DSPARK_FORBID_REFERENCE_SKIP", "").split(","))))
'''

if __name__ == "__main__":  # list what is forbidden
    print("\n".join(f"{f.__module__}.{f.__qualname__}" for f in reference_stage_functions()), file=sys.stdout)
