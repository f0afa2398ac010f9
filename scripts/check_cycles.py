#!/usr/bin/env python3
"""Fail when the modules of a Rust crate, or of a Python package, import each other in a cycle.

Usage: scripts/check_cycles.py crates/kvfork/src python/kvfork [more crates' src/ or packages]

Rust: every `.rs` file under `src/` is a module (`lib.rs` the root, `x/mod.rs` the module
`x`). Its dependencies are the paths it names from inside the crate: `use crate::...`,
`use super::...`, `use child::...` (a module declared beside it) and qualified paths such as
`crate::x::f()` in code. A path counts as a dependency on the deepest module it names.

Python: every `.py` file of the package is a module (`__init__.py` its folder's). Its
dependencies are its imports of the package's own modules, absolute (`kvfork.server.app`)
or relative (`from .app import x`, `from .. import x`), wherever they are: at the top, in a
function (a lazy import), or under `if TYPE_CHECKING:`. The rule for the last two: they
count. A lazy import still makes two modules that need each other, and a type-only import
still makes two modules that cannot be read (or moved) apart; the cure is the same, a third
module both import.

The check is levelled, as a module tree reads: an import between two modules counts as an
arrow between their ancestors that are siblings (`engine/commit.rs` importing `branch.rs`
is `engine -> branch`), and the arrows among the children of each module must not form a
cycle. A module's imports of its own ancestors or descendants (a child using its parent's
items, a parent re-exporting a child's) stay inside that module and are not arrows.

Exit status 1, with each cycle and the imports that close it, when one is found.
Standard library only.
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
from collections import defaultdict
from pathlib import Path

Module = tuple[str, ...]
# (importing file, line, path as written)
Evidence = tuple[Path, int, str]

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
USE_RE = re.compile(r"\buse\s+([^;]+);")
PATH_RE = re.compile(rf"(?<![\w:])((?:crate|super|self)(?:\s*::\s*{IDENT})+)")
MOD_OPEN_RE = re.compile(rf"\bmod\s+({IDENT})\s*\{{")


def module_of(src: Path, file: Path) -> Module:
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts == ["lib"] or parts == ["main"]:
        return ()
    if parts[-1] == "mod":
        parts.pop()
    return tuple(parts)


def strip_comments_and_strings(text: str) -> str:
    """Blank out comments, string and char literals, keeping line breaks (for line numbers)."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and (i == 0 or not text[i - 1].isalnum()):
            hashes = re.match(r"r(#*)\"", text[i:])
            assert hashes is not None
            close = '"' + hashes.group(1)
            j = text.find(close, i + len(hashes.group(0)))
            j = n if j < 0 else j + len(close)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i : i + 4]):
            # A char literal ('x', '\n'); a lifetime ('a) has no closing quote.
            j = text.find("'", i + 1 if text[i + 1] != "\\" else i + 3)
            out.append("' '")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def split_top(s: str) -> list[str]:
    """Split a use-tree list at the commas outside braces."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


def expand_use(tree: str) -> list[list[str]]:
    """`a::{b, c::{d, e as f}}` -> [[a, b], [a, c, d], [a, c, e]]."""
    tree = re.sub(r"\s+", "", re.sub(rf"\s+as\s+{IDENT}", "", tree))
    brace = tree.find("{")
    if brace < 0:
        path = [p for p in tree.split("::") if p and p != "*"]
        if path and path[-1] == "self":
            path.pop()
        return [path]
    prefix = [p for p in tree[:brace].split("::") if p]
    inner = tree[brace + 1 : tree.rfind("}")]
    paths = []
    for item in split_top(inner):
        for rest in expand_use(item):
            paths.append(prefix + rest)
    return paths


class Crate:
    def __init__(self, src: Path) -> None:
        self.src = src
        self.files = sorted(src.rglob("*.rs"))
        self.modules: dict[Module, Path] = {module_of(src, f): f for f in self.files}

    def resolve(self, segments: list[str], here: Module) -> Module | None:
        """The deepest module of the crate that `segments` (written in `here`) names."""
        if not segments:
            return None
        head, rest = segments[0], segments[1:]
        base: Module
        if head == "crate":
            base = ()
        elif head == "self":
            base = here
        elif head == "super":
            base, rest = here, segments
            while rest and rest[0] == "super":
                if not base:
                    return None
                base, rest = base[:-1], rest[1:]
        elif (*here, head) in self.modules:
            base = (*here, head)
        else:
            return None  # another crate (std, kvfork_core, ...)
        found = base
        for seg in rest:
            if (*found, seg) in self.modules:
                found = (*found, seg)
            else:
                break
        return found

    def imports(self, file: Path) -> list[tuple[Module, Evidence]]:
        here = module_of(self.src, file)
        text = strip_comments_and_strings(file.read_text(encoding="utf-8"))
        # Where inline `mod x { ... }` blocks open and close: `super` inside one means the file.
        line_starts = [0] + [m.end() for m in re.finditer("\n", text)]

        def line_of(pos: int) -> int:
            lo, hi = 0, len(line_starts)
            while lo + 1 < hi:
                mid = (lo + hi) // 2
                if line_starts[mid] <= pos:
                    lo = mid
                else:
                    hi = mid
            return lo + 1

        inline: list[tuple[int, int, str]] = []  # (start, end, name)
        for m in MOD_OPEN_RE.finditer(text):
            depth, j = 1, m.end()
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            inline.append((m.end(), j, m.group(1)))

        def scope(pos: int) -> Module:
            names = [name for start, end, name in sorted(inline) if start <= pos < end]
            return here + tuple(names)

        found: list[tuple[Module, Evidence]] = []
        use_spans = []
        for m in USE_RE.finditer(text):
            use_spans.append((m.start(), m.end()))
            at = scope(m.start())
            for path in expand_use(m.group(1)):
                target = self.resolve(path, at)
                if target is not None:
                    evidence = (file, line_of(m.start()), "use " + "::".join(path))
                    found.append((target, evidence))
        for m in PATH_RE.finditer(text):
            if any(s <= m.start() < e for s, e in use_spans):
                continue
            path = re.sub(r"\s+", "", m.group(1)).split("::")
            target = self.resolve(path, scope(m.start()))
            if target is not None:
                found.append((target, (file, line_of(m.start()), "::".join(path))))
        # Paths inside an inline module that resolve into the file itself (or its inline
        # children) are the file's own business.
        return [(t[: len(here)] if t[: len(here)] == here else t, e) for t, e in found]


class Package:
    """A Python package: its modules and their imports of each other."""

    def __init__(self, root: Path) -> None:
        self.src = root
        self.name = root.name
        self.files = sorted(root.rglob("*.py"))
        self.modules: dict[Module, Path] = {self.module_of(f): f for f in self.files}

    def module_of(self, file: Path) -> Module:
        parts = list(file.relative_to(self.src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return tuple(parts)

    def deepest(self, parts: list[str]) -> Module:
        found: Module = ()
        for part in parts:
            if (*found, part) in self.modules:
                found = (*found, part)
            else:
                break
        return found

    def imports(self, file: Path) -> list[tuple[Module, Evidence]]:
        """The package's modules `file` imports (the deepest module each import names)."""
        here = self.module_of(file)
        package = here if file.name == "__init__.py" else here[:-1]
        found: list[tuple[Module, Evidence]] = []
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets: list[list[str]] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == self.name:
                        targets.append(parts[1:])
            else:
                module = node.module.split(".") if node.module else []
                if node.level:  # relative: from the package `level - 1` folders up
                    up = node.level - 1
                    if up > len(package):
                        continue
                    base = [*package[: len(package) - up], *module]
                elif module and module[0] == self.name:
                    base = module[1:]
                else:
                    continue  # another package
                # `from x import y`: y is a module of x, or a name defined in x.
                targets += [[*base, alias.name] for alias in node.names]
            for target in targets:
                found.append((self.deepest(target), (file, node.lineno, ".".join(target))))
        return found


def common_prefix(a: Module, b: Module) -> Module:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (as a closed list of nodes), or None."""
    white, grey, black = 0, 1, 2
    color: dict[str, int] = defaultdict(int)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = grey
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if color[nxt] == grey:
                return [*stack[stack.index(nxt) :], nxt]
            if color[nxt] == white:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        color[node] = black
        return None

    for node in sorted(graph):
        if color[node] == white:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def check(src: Path) -> list[str]:
    crate: Crate | Package = Package(src) if (src / "__init__.py").exists() else Crate(src)
    # parent module -> child name -> child names it imports, with the evidence of each arrow
    graphs: dict[Module, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    why: dict[tuple[Module, str, str], list[Evidence]] = defaultdict(list)
    for file in crate.files:
        here = crate.module_of(file) if isinstance(crate, Package) else module_of(src, file)
        for target, evidence in crate.imports(file):
            top = common_prefix(here, target)
            if top in (here, target):
                continue  # an ancestor or a descendant: inside one module
            a, b = here[len(top)], target[len(top)]
            graphs[top][a].add(b)
            why[(top, a, b)].append(evidence)
    problems = []
    for parent in sorted(graphs):
        graph = graphs[parent]
        # Report every cycle: remove one arrow of each found, look again.
        while (cycle := find_cycle(graph)) is not None:
            where = (
                ".".join((crate.name, *parent))
                if isinstance(crate, Package)
                else "::".join(("crate", *parent))
            )
            lines = [f"import cycle among the modules of {where}: " + " -> ".join(cycle)]
            for a, b in itertools.pairwise(cycle):
                for file, line, path in why[(parent, a, b)][:3]:
                    lines.append(f"  {a} -> {b}: {file}:{line}: {path}")
            problems.append("\n".join(lines))
            graph[cycle[0]].discard(cycle[1])
    return problems


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    problems = []
    for arg in argv:
        src = Path(arg)
        rust = (src / "lib.rs").exists() or (src / "main.rs").exists()
        if not rust and not (src / "__init__.py").exists():
            print(
                f"{src}: no lib.rs, main.rs or __init__.py (give a crate's src/ folder or a "
                "Python package)",
                file=sys.stderr,
            )
            return 2
        problems += check(src)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
