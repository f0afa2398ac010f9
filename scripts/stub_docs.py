#!/usr/bin/env python3
"""Keep the docstrings of python/kvfork/_native.pyi equal to those of the installed extension.

pyo3 takes the docstrings of kvfork._native from the Rust `///` comments; editors read the
stub instead, so the stub carries a copy of each. This script makes that copy mechanical:

    python scripts/stub_docs.py --check   # exit 1 listing every drift (the `make lint` gate)
    python scripts/stub_docs.py --write   # rewrite the stub's docstrings in place

For every class, function, method and property defined in the stub, the runtime object is
looked up in the installed `kvfork._native` (a method's on its class, through the MRO). Its
docstring goes into the stub as the first statement of the definition's body; where the
runtime object has none, the stub has none either. Docstrings are compared after
`inspect.cleandoc` with trailing whitespace removed from each line (what `help()` shows;
`ruff format` strips trailing whitespace inside docstrings anyway).

Not copied, because they are CPython's generic texts rather than kvfork's documentation:
the docstrings of slot wrappers (`__iter__`: "Implement iter(self)."), of a pyo3
constructor's `__new__` ("Create and return a new object...") and of anything inherited from
a builtin class (`BaseException.add_note`).

Overloads: the docstring goes on the first `@overload` of a name only (mypy and stubtest
accept a docstring as an overload's body). Property setters and deleters get none (the
getter's is the property's). Definitions with no runtime counterpart
(stub-only helpers such as `_ContextOptions`) are left as they are; stubtest reports a public
one that is missing at run time.

`--write` formats the stub with ruff afterwards (`python -m ruff format`), as `make lint`
expects. Run it against a fresh build: `make lint` runs `--check` after stubtest, so a change
to a Rust `///` comment fails the lint until `--write` has been run and the stub committed.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

STUB = Path(__file__).resolve().parent.parent / "python" / "kvfork" / "_native.pyi"
MODULE = "kvfork._native"
_MISSING = object()


def normalize(doc: str | None) -> str | None:
    """A docstring as compared: cleandoc'ed, trailing whitespace dropped; None when empty."""
    if doc is None:
        return None
    text = "\n".join(line.rstrip() for line in inspect.cleandoc(doc).splitlines()).strip()
    return text or None


def lookup(owner: object, name: str) -> object:
    """`owner.name` found statically (a property gives its descriptor, a classmethod its
    descriptor), through the MRO for a class; _MISSING when there is none."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                return vars(klass)[name]
        return _MISSING
    return getattr(owner, name, _MISSING)


def _generic(owner: object, name: str, obj: object) -> bool:
    """True when `obj`'s docstring is CPython's generic text, not kvfork's documentation."""
    if isinstance(obj, types.WrapperDescriptorType):
        return True  # slot wrappers: "Implement iter(self).", "Return hash(self)." ...
    if name == "__new__" and getattr(obj, "__doc__", None) == object.__new__.__doc__:
        return True
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                return klass.__module__ == "builtins"
    return False


def runtime_doc(owner: object, name: str, obj: object) -> str | None:
    """The normalized docstring of `obj`, found as `owner.name` at run time: None when it
    has none, or only a generic one."""
    if _generic(owner, name, obj):
        return None
    if isinstance(obj, staticmethod | classmethod):
        obj = obj.__func__
    if isinstance(obj, type):
        doc = vars(obj).get("__doc__")  # a class's own docstring, never its base's
        return normalize(doc if isinstance(doc, str) else None)
    doc = getattr(obj, "__doc__", None)
    return normalize(doc if isinstance(doc, str) else None)


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Attribute):
            names.add(target.attr)  # overload (typing.overload), setter, deleter
    return names


_Def = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Entry:
    """One definition of the stub and the docstring it should carry."""

    qualname: str
    node: _Def
    want: str | None  # normalized runtime docstring (None: the stub should have none)

    @property
    def have(self) -> str | None:
        return normalize(ast.get_docstring(self.node, clean=False))


def entries(tree: ast.Module, runtime: object) -> Iterator[Entry]:
    """Every definition of the stub with a runtime counterpart, with the wanted docstring."""

    def walk(body: list[ast.stmt], owner: object, prefix: str) -> Iterator[Entry]:
        seen_overload: set[str] = set()
        for node in body:
            if not isinstance(node, _Def):
                continue
            qualname = prefix + node.name
            obj = lookup(owner, node.name)
            if obj is _MISSING:
                continue  # stub-only (a private helper type, or reported by stubtest)
            want = runtime_doc(owner, node.name, obj)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                decorators = _decorator_names(node)
                if decorators & {"setter", "deleter"}:
                    want = None
                elif "overload" in decorators:
                    if node.name in seen_overload:
                        want = None
                    seen_overload.add(node.name)
            yield Entry(qualname, node, want)
            if isinstance(node, ast.ClassDef):
                yield from walk(node.body, obj, qualname + ".")

    yield from walk(tree.body, runtime, "")


def drifts(items: list[Entry]) -> list[str]:
    out = []
    for e in items:
        have, want = e.have, e.want
        if have == want:
            continue
        if have is None:
            out.append(f"{e.qualname}: missing (the runtime docstring is not in the stub)")
        elif want is None:
            out.append(f"{e.qualname}: the stub has a docstring the runtime object lacks")
        else:
            out.append(f"{e.qualname}: differs from the runtime docstring")
    return out


_CONTROL = {"\t": "\\t", "\r": "\\r", "\f": "\\f", "\v": "\\v"}


def _escape(line: str, closing: bool = False) -> str:
    """`line` as it must be written inside a triple-double-quoted string (`closing`: the
    closing quotes follow it on the same line)."""
    text = "".join(
        _CONTROL.get(ch, f"\\x{ord(ch):02x}") if ord(ch) < 0x20 or ch == "\x7f" else ch
        for ch in line.replace("\\", "\\\\")
    ).replace('"""', '""\\"')
    if closing and text.endswith('"'):
        text = text[:-1] + '\\"'
    return text


def render(doc: str, indent: str) -> list[str]:
    """The lines of a docstring statement for `doc` at `indent`: one line when it fits on
    one, else closing quotes on their own line."""
    lines = doc.split("\n")
    if len(lines) == 1:
        return [f'{indent}"""{_escape(lines[0], closing=True)}"""']
    out = [f'{indent}"""{_escape(lines[0])}']
    out += [f"{indent}{_escape(line)}" if line else "" for line in lines[1:]]
    out.append(f'{indent}"""')
    return out


def _first_line(node: ast.stmt) -> int:
    """1-based first line of a statement, its decorators included."""
    decorators: list[ast.expr] = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])


def _is_ellipsis(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and stmt.value.value is Ellipsis
    )


def _edit(e: Entry, lines: list[str]) -> tuple[int, int, list[str]]:
    """(first line index, end line index (exclusive), replacement lines) that give `e` the
    docstring it wants."""
    node, body = e.node, e.node.body
    first = body[0]
    has_doc = ast.get_docstring(node, clean=False) is not None
    row = first.lineno - 1
    head = lines[row][: first.col_offset]
    if head.strip():
        # `def f() -> T: ...`, or a multi-line header ending in `: ...`: the whole body on
        # the header's last line.
        tail = lines[row][first.end_col_offset :].strip()
        if len(body) != 1 or first.end_lineno != first.lineno or tail:
            raise SystemExit(f"{e.qualname}: cannot rewrite line {first.lineno}")
        head = head.rstrip()
        if e.want is None:
            return row, row + 1, [f"{head} ..."]
        return row, row + 1, [head, *render(e.want, " " * (node.col_offset + 4))]
    indent = " " * first.col_offset
    end = first.end_lineno or first.lineno
    if e.want is None:  # drop the docstring (leaving `...` when it was the whole body)
        return row, end, [] if len(body) > 1 else [f"{indent}..."]
    if has_doc or (len(body) == 1 and _is_ellipsis(first)):
        return row, end, render(e.want, indent)
    at = _first_line(first) - 1
    return at, at, render(e.want, indent)


def rewrite(source: str, items: list[Entry]) -> str:
    """`source` with every entry's docstring made equal to the one it wants."""
    lines = source.split("\n")
    edits = [_edit(e, lines) for e in items if e.have != e.want]
    for start, end, new in sorted(edits, key=lambda edit: edit[:2], reverse=True):
        lines[start:end] = new
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 listing every drift")
    mode.add_argument("--write", action="store_true", help="rewrite the stub in place")
    parser.add_argument("--stub", type=Path, default=STUB, help=f"default: {STUB}")
    args = parser.parse_args(argv)

    runtime = importlib.import_module(MODULE)
    source = args.stub.read_text(encoding="utf-8")
    items = list(entries(ast.parse(source), runtime))
    found = drifts(items)
    where = f"{args.stub} against {getattr(runtime, '__file__', MODULE)}"
    if args.check:
        if found:
            print(f"{len(found)} docstring drifts in {where}:", file=sys.stderr)
            for line in found:
                print(f"  {line}", file=sys.stderr)
            print("Run `python scripts/stub_docs.py --write` and commit.", file=sys.stderr)
            return 1
        documented = sum(e.want is not None for e in items)
        print(f"{args.stub.name}: {documented} docstrings of {len(items)} definitions match")
        return 0
    if not found:
        print(f"{args.stub.name}: nothing to write")
        return 0
    new = rewrite(source, items)
    after = list(entries(ast.parse(new), runtime))  # never write a stub that fails --check
    left = drifts(after)
    if left:
        print("internal error: the rewritten stub still drifts:", *left, sep="\n  ")
        return 2
    args.stub.write_text(new, encoding="utf-8")
    # The blank lines and line joins `make lint` expects around the new bodies.
    fmt = [sys.executable, "-m", "ruff", "format", "--quiet", str(args.stub)]
    if subprocess.run(fmt, check=False).returncode != 0:
        print(f"`{' '.join(fmt)}` failed: run `make fmt` before committing", file=sys.stderr)
    print(f"{args.stub.name}: rewrote {len(found)} docstrings")
    for line in found:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
