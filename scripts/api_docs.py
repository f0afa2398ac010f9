#!/usr/bin/env python3
"""Write `docs/api.md`, the API reference, as plain Markdown (readable on GitHub as in the
documentation site), from the sources: the stub `python/kvfork/_native.pyi` for the classes
and functions implemented in Rust (its docstrings equal the extension's: `stub_docs.py`),
and the Python modules for the rest. Nothing is imported, so it runs without a build.

    python scripts/api_docs.py --check   # exit 1 when docs/api.md is not what it would write
    python scripts/api_docs.py --write   # rewrite docs/api.md

`make lint` runs `--check`: a changed signature or docstring fails it until `--write` has
been run and the page committed. The names documented, and their order, are `SECTIONS`.
Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "kvfork"
PAGE = ROOT / "docs" / "api.md"

INTRO = """\
Every public class and function, with its signature and documentation. Everything in the
first section is importable from the top-level package (`import kvfork`); the search
patterns are in `kvfork.patterns`, the Ray pool in `kvfork.ray`. Calls that run the model
are `async` and each has a blocking `*_sync` twin (see [Concepts](concepts.md)); an `async`
call returns an `Operation`, which runs at once and is awaited for its result.

This page is generated from the sources (`scripts/api_docs.py`; the Rust-implemented names
from the stub `python/kvfork/_native.pyi`): edit the docstrings, not this page.
"""

#: (module, heading, names in the order shown)
SECTIONS: list[tuple[str, str, list[str]]] = [
    (
        "kvfork",
        "kvfork",
        [
            "create_context",
            "create_context_sync",
            "ContextOpening",
            "Context",
            "Model",
            "SamplingParams",
            "Branch",
            "BranchStore",
            "PrefixCache",
            "Operation",
            "Token",
            "TokenStream",
            "TokenStreamSync",
            "FormattedChat",
            "Chat",
            "LoraAdapter",
            "ControlVector",
            "Drafter",
            "PromptLookup",
            "DraftModel",
            "SpeculativeStream",
            "SpeculativeStreamSync",
            "default_model_path",
            "default_chat_model_path",
            "json_schema_to_grammar",
            "system_info",
            "set_log_level",
            "KvforkError",
            "ModelLoadError",
            "DecodeError",
            "KvCacheFullError",
            "LeaseExhaustedError",
            "BranchDisposedError",
            "GrammarError",
            "ChatTemplateError",
            "StateFileError",
            "KvforkWarning",
        ],
    ),
    (
        "kvfork.patterns",
        "kvfork.patterns: search and ranking over forks",
        ["beam_search", "beam_search_sync", "Beam", "rank", "rank_sync", "Ranked"],
    ),
    (
        "kvfork.ray",
        "kvfork.ray: branch programs on Ray actors (the `ray` extra)",
        ["ContextPool", "shared"],
    ),
]

Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def module_file(module: str) -> Path:
    """The source of `kvfork.x.y` (the stub for the extension)."""
    parts = module.split(".")[1:]
    if parts == ["_native"]:
        return PACKAGE / "_native.pyi"
    path = PACKAGE.joinpath(*parts)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def parse(module: str) -> ast.Module:
    return ast.parse(module_file(module).read_text(encoding="utf-8"))


def find(module: str, name: str) -> tuple[str, Definition]:
    """The definition of `name` as `module` exposes it (following `from .x import name`)."""
    tree = parse(module)
    for node in tree.body:
        if isinstance(node, Definition) and node.name == name:
            return module, node
    for node in tree.body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 1
            and node.module
            and any((a.asname or a.name) == name for a in node.names)
        ):
            is_package = module_file(module).name == "__init__.py"
            package = module if is_package else module.rsplit(".", 1)[0]
            return find(f"{package}.{node.module}", name)
    raise SystemExit(f"api_docs.py: {name} is not defined in {module}")


def doc(node: Definition) -> str:
    text = ast.get_docstring(node, clean=True) or ""
    return "\n".join(line.rstrip() for line in text.splitlines()).strip()


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool) -> str:
    """`(args) -> returns`, without `self` / `cls`."""
    args = fn.args
    if drop_first:
        if args.posonlyargs:
            args = ast.arguments(**{**args.__dict__, "posonlyargs": args.posonlyargs[1:]})
        elif args.args:
            args = ast.arguments(**{**args.__dict__, "args": args.args[1:]})
    text = f"({ast.unparse(args)})"
    if fn.returns is not None:
        text += f" -> {ast.unparse(fn.returns)}"
    return text


def decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {ast.unparse(d) for d in fn.decorator_list}


def render_function(fn: ast.FunctionDef | ast.AsyncFunctionDef, heading: str) -> list[str]:
    kind = "async def" if isinstance(fn, ast.AsyncFunctionDef) else "def"
    out = [
        f"{heading} `{fn.name}`",
        "",
        "```python",
        f"{kind} {fn.name}{signature(fn, False)}",
        "```",
        "",
    ]
    if text := doc(fn):
        out += [text, ""]
    return out


def members(cls: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Public methods and properties, in source order; of overloads, the documented one."""
    seen: set[str] = set()
    out = []
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        public = not node.name.startswith("_") or node.name in ("__new__", "__init__")
        if not public or node.name in seen:
            continue
        if "overload" in decorators(node) and not doc(node):
            continue
        if any(d.endswith((".setter", ".deleter")) for d in decorators(node)):
            continue
        seen.add(node.name)
        out.append(node)
    return out


def overloads(
    cls: ast.ClassDef, fn: ast.FunctionDef | ast.AsyncFunctionDef
) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """`fn`'s overloads in `cls`, in source order (`fn` alone when it has none)."""
    if "overload" not in decorators(fn):
        return [fn]
    return [
        node
        for node in cls.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name == fn.name
        and "overload" in decorators(node)
    ]


def render_class(cls: ast.ClassDef) -> list[str]:
    bases = [ast.unparse(b) for b in cls.bases if ast.unparse(b) not in ("Generic[_T]", "Protocol")]
    head = f"class {cls.name}" + (f"({', '.join(bases)})" if bases else "")
    out = [f"### `{cls.name}`", "", "```python", head, "```", ""]
    if text := doc(cls):
        out += [text, ""]
    for fn in members(cls):
        decos = decorators(fn)
        if fn.name in ("__new__", "__init__"):
            sig = signature(fn, True).split(" -> ")[0]
            if sig == "(*args, **kwargs)" or not (doc(fn) or sig != "()"):
                continue
            line = f"{cls.name}{sig}"
        elif "property" in decos:
            returns = ast.unparse(fn.returns) if fn.returns is not None else "Any"
            line = f"{cls.name}.{fn.name}: {returns}  # property"
        else:
            # Every overload's signature (a `draft: Drafter` one returns another type).
            line = "\n".join(
                f"{'async ' if isinstance(f, ast.AsyncFunctionDef) else ''}{cls.name}.{f.name}"
                f"{signature(f, 'staticmethod' not in decorators(f))}"
                for f in overloads(cls, fn)
            )
        out += ["```python", line, "```", ""]
        if text := doc(fn):
            out += [text, ""]
    return out


def page() -> str:
    out = ["# API reference", "", INTRO]
    for module, heading, names in SECTIONS:
        out += [f"## {heading}", ""]
        for name in names:
            _, node = find(module, name)
            if isinstance(node, ast.ClassDef):
                out += render_class(node)
            else:
                out += render_function(node, "###")
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    args = ap.parse_args()
    text = page()
    if args.write:
        PAGE.write_text(text, encoding="utf-8")
        print(f"{PAGE.relative_to(ROOT)}: {len(text.splitlines())} lines")
        return 0
    current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
    if current == text:
        print(f"{PAGE.relative_to(ROOT)}: up to date")
        return 0
    diff = difflib.unified_diff(
        current.splitlines(), text.splitlines(), "docs/api.md", "generated", lineterm="", n=1
    )
    print("\n".join(list(diff)[:60]))
    print("docs/api.md is stale: run python scripts/api_docs.py --write", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
