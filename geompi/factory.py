"""``--model`` and ``--dataset`` given as ``pkg.module:factory``: the user's own callables.

A spec is a dotted module path, a colon and a dotted attribute path (``mypkg.nets:make_net``,
``nets:Registry.small``). The module is imported with importlib on the worker ranks that build
the model and the data (servers build neither), so it must be importable there: on
``PYTHONPATH`` (``mpirun -x PYTHONPATH``) or in the working directory of every node.

:func:`check_spec` is pure (syntax only) and runs in ``RunConfig.validate()`` on every rank;
:func:`resolve` imports, and every failure is one-line ConfigError that names the flag, the spec
and the fix, so the workers report it together at start-up (``agree_or_exit``).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from geompi.errors import ConfigError, GeompiError

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_SPEC = re.compile(rf"({_DOTTED}):({_DOTTED})")


def is_spec(value: str) -> bool:
    """Whether ``value`` names a factory (it holds a colon) rather than a built-in."""
    return isinstance(value, str) and ":" in value


def check_spec(flag: str, value: str) -> None:
    """Raise ConfigError unless ``value`` is ``module.path:attribute`` (syntax only)."""
    if not _SPEC.fullmatch(value.strip()):
        raise ConfigError(
            f"{flag} {value!r} is not MODULE:FACTORY: write a dotted module and a callable in "
            "it, e.g. mypkg.nets:make_net"
        )


def resolve(flag: str, value: str) -> Callable:
    """Import the module of ``value`` and return the callable it names."""
    check_spec(flag, value)
    module_name, attr = value.strip().split(":")
    where = f"{flag} {value}"
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(
                f"{where}: cannot import {module_name} (no module named {missing!r}): put its "
                "directory on PYTHONPATH on every rank (mpirun -x PYTHONPATH)"
            ) from None
        raise ConfigError(
            f"{where}: importing {module_name} failed: {brief(e)}: install what it imports"
        ) from None
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is reported
        raise ConfigError(f"{where}: importing {module_name} raised {brief(e)}") from None
    path = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{where}: {path} has no attribute {part!r}: check the name after the colon"
            )
        obj = getattr(obj, part)
        path += ("." if path != module_name else ":") + part
    if not callable(obj):
        raise ConfigError(f"{where}: {path} is not callable (its type is {type(obj).__name__})")
    return obj


def accepts(factory: Callable, *args) -> bool:
    """Whether ``factory`` can be called with ``args`` (by its signature; True if it has none)."""
    import inspect

    try:
        inspect.signature(factory).bind(*args)
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): assume it does
        return True
    return True


def call(flag: str, value: str, factory: Callable, *args, error: type = ConfigError):
    """``factory(*args)``; an exception from it becomes one ``error`` line."""
    try:
        return factory(*args)
    except GeompiError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the user's code is reported
        shown = ", ".join(repr(a) for a in args)
        name = value.strip().partition(":")[2]
        raise error(f"{flag} {value}: {name}({shown}) raised {brief(e)}") from None


def brief(err: BaseException) -> str:
    """``Type: first line of the message``, for one-line reports."""
    text = str(err).strip().splitlines()
    return type(err).__name__ + (f": {text[0]}" if text else "")
