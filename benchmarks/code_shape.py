"""The shape of the product code: module sizes, the longest functions, storage-scheme branches, docstrings.

    .venv/bin/python benchmarks/code_shape.py [--root DIR] [--markdown]

Reads the product's Python files (src/hsextract, tasks, flows, deployments) as text and AST; runs nothing.
- lines per module: physical lines, median and largest;
- the 10 longest functions and methods (first line of the `def` to its last line);
- places that branch on the output's scheme: a call of `startswith`/`removeprefix`/`endswith` with a
  `s3://` or `file://` literal, a comparison with such a literal, or `"://" in ...`;
- public definitions (module-level functions and classes, and methods, whose names do not start with `_`)
  that have a docstring (a method overriding a documented one of a base class has it).
`--root` measures another checkout (e.g. a `git worktree` of an older commit) for a before/after table.
"""

from __future__ import annotations

import argparse
import ast
import statistics
from pathlib import Path

PRODUCT = ("src/hsextract", "tasks", "flows", "deployments")
SCHEMES = ("s3://", "file://", "://")


def modules(root: Path) -> list[Path]:
    return sorted(p for part in PRODUCT for p in (root / part).rglob("*.py") if "__pycache__" not in p.parts)


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node.end_lineno - node.lineno + 1
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")


def is_scheme_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in SCHEMES


def scheme_branches(tree: ast.AST) -> list[int]:
    """Line numbers of expressions that ask which scheme a URI has."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("startswith", "removeprefix", "endswith")
                and any(is_scheme_literal(a) for a in node.args)):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(is_scheme_literal(n) for n in [node.left, *node.comparators]):
            lines.append(node.lineno)
    return sorted(lines)


def classes_of(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def public_definitions(tree: ast.Module, classes: dict[str, ast.ClassDef]):
    """(name, has docstring) of module-level functions and classes and their methods, public ones only. A method
    that overrides a documented method of a base class (any product module's class of that name) has that
    one's docstring, as `inspect.getdoc` says."""
    def documented(cls: ast.ClassDef) -> set[str]:
        names = {item.name for item in cls.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and ast.get_docstring(item) is not None}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes and classes[base.id] is not cls:
                names |= documented(classes[base.id])
        return names

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield node.name, ast.get_docstring(node) is not None
            if isinstance(node, ast.ClassDef):
                inherited = documented(node)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                        yield f"{node.name}.{item.name}", item.name in inherited


def measure(root: Path) -> dict:
    sizes, longest, branches, documented, public = {}, [], {}, 0, 0
    trees = {path: ast.parse(path.read_text()) for path in modules(root)}
    classes = {name: node for tree in trees.values() for name, node in classes_of(tree).items()}
    for path, tree in trees.items():
        text = path.read_text()
        rel = path.relative_to(root).as_posix()
        sizes[rel] = len(text.splitlines())
        longest += [(lines, f"{rel}:{name}") for name, lines in functions(tree)]
        if found := scheme_branches(tree):
            branches[rel] = found
        for _, has in public_definitions(tree, classes):
            public += 1
            documented += has
    longest.sort(reverse=True)
    return {"modules": len(sizes), "lines": sum(sizes.values()), "median": statistics.median(sizes.values()),
            "largest": max(sizes.items(), key=lambda kv: kv[1]), "sizes": sizes, "longest": longest[:10],
            "branches": branches, "public": public, "documented": documented}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--markdown", action="store_true", help="print the per-module table too")
    args = ap.parse_args()
    m = measure(args.root)
    print(f"{m['modules']} product modules, {m['lines']} lines; median {m['median']:g} lines, largest "
          f"{m['largest'][0]} ({m['largest'][1]} lines)")
    print("10 longest functions:")
    for lines, name in m["longest"]:
        print(f"  {lines:4d}  {name}")
    total = sum(len(v) for v in m["branches"].values())
    print(f"places that branch on local vs s3:// ({total}):")
    for rel, lines in sorted(m["branches"].items()):
        print(f"  {rel}: lines {', '.join(map(str, lines))}")
    print(f"public definitions with a docstring: {m['documented']} of {m['public']} "
          f"({100 * m['documented'] / max(1, m['public']):.0f}%)")
    if args.markdown:
        print("\n| module | lines |\n|---|---|")
        for rel, n in sorted(m["sizes"].items(), key=lambda kv: -kv[1]):
            print(f"| {rel} | {n} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
