"""Every public name has a docstring: `help(kvfork.X)` is a user's first manual."""

from __future__ import annotations

import inspect

import kvfork


def _undocumented() -> list[str]:
    """Public names of kvfork (and the public members of its classes) with no docstring."""
    missing: list[str] = []
    for name in kvfork.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(kvfork, name)
        doc = (getattr(obj, "__doc__", None) or "").strip()
        if not doc or (inspect.isclass(obj) and obj.__doc__ == type.__doc__):
            missing.append(name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for member, value in vars(obj).items():
                if member.startswith("_") and member != "__init__":
                    continue
                if not (getattr(value, "__doc__", None) or "").strip():
                    missing.append(f"{name}.{member}")
    return missing


def test_every_public_name_has_a_docstring() -> None:
    missing = _undocumented()
    assert not missing, f"{len(missing)} public names lack a docstring: {' '.join(missing)}"
