"""The shape of the product code: module sizes, the longest functions, import cycles, settings, scheme branches,
repeated code, docstrings, and the lint and type findings.

    .venv/bin/python benchmarks/code_shape.py [--root DIR] [--markdown] [--json FILE]

Reads the product's Python files (src/hsextract, tasks, flows, deployments) as text and AST; runs nothing.
- lines per module: physical lines, median and largest;
- the 10 longest functions and methods (first line of the `def` to its last line);
- modules and lines per package (hsextract, hsextract.store, tasks, flows, deployments);
- import cycles between product modules (every `import`, lazy ones inside functions too: a cycle is one
  design however it is spelled at run time; those under `if TYPE_CHECKING:` name a type only), and private names (`_x`) imported from another module;
- places that state a setting's value: for every parameter of the `extract` flow, each function parameter
  default, class field default, argparse `default=`, entry of a dict literal with two or more settings as keys, or keyword argument with a literal
  value (not `None`: it states none) under its name (one each is the goal);
- reads of a setting by its name out of a mapping (`p["max_length"]`, `params.get("hosts")`) in the
  orchestrator (tasks, flows, deployments): what typed settings replace;
- places that branch on the output's scheme outside the store package (`hsextract/store`): a call of `startswith`/`removeprefix`/`endswith` with a
  `s3://` or `file://` literal, a comparison with such a literal, or `"://" in ...`;
- public definitions (module-level functions and classes, and methods, whose names do not start with `_`)
  that have a docstring (a method overriding a documented one of a base class has it).
- `sys.path` insertions anywhere (product, tests, benchmarks, scripts);
- repeated code: blocks of 6 or more consecutive identical lines (stripped; blank and comment lines left out)
  in two places of the product;
- exception classes and the modules defining them; the names used for "can a retry help?";
- lines over 100 characters; ruff and mypy findings where they are installed (else "not installed").
`--root` measures another checkout (e.g. a `git worktree` of an older commit) for a before/after table.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PRODUCT = ("src/hsextract", "tasks", "flows", "deployments")
EVERYWHERE = ("src", "tasks", "flows", "deployments", "tests", "benchmarks", "scripts")
STORE = "src/hsextract/store/"
RETRY_WORDS = ("transient", "mistake", "retryable", "retry")
WINDOW = 6
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


def module_name(rel: str) -> str:
    """`src/hsextract/store/s3.py` -> `hsextract.store.s3`; `tasks/plan.py` -> `tasks.plan`."""
    parts = rel.removeprefix("src/").removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(name: str, names: set[str]) -> str:
    """The package a module belongs to (a package's own `__init__` belongs to it)."""
    return name if name in names and any(n.startswith(name + ".") for n in names) else name.rsplit(".", 1)[0]


def imports(tree: ast.AST, name: str, is_package: bool, names: set[str]) -> list[tuple[str, str, int]]:
    """(imported product module, imported name or "", line) of every import in a module, lazy ones too (not
    those under `if TYPE_CHECKING:`)."""
    found = []
    here = name.split(".") if is_package else name.split(".")[:-1]
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
        node.test) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name in names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            for alias in node.names:
                if f"{base}.{alias.name}" in names:
                    found.append((f"{base}.{alias.name}", "", node.lineno))
                elif base in names:
                    found.append((base, alias.name, node.lineno))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out, key=len, reverse=True)


def flow_parameters(trees: dict[str, ast.Module]) -> list[str]:
    """The `extract` flow's parameter names (flows/extract.py)."""
    for node in ast.walk(trees.get("flows/extract.py", ast.Module(body=[], type_ignores=[]))):
        if isinstance(node, ast.FunctionDef) and node.name == "extract":
            return [a.arg for a in node.args.args + node.args.kwonlyargs]
    return []


def is_literal(node: ast.AST | None) -> bool:
    """A constant, or a tuple/list of constants, or a negative number; `None` is none (it states no value)."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.UnaryOp):
        return is_literal(node.operand)
    return isinstance(node, (ast.Tuple, ast.List)) and all(is_literal(e) for e in node.elts)


def setting_values(tree: ast.AST, settings: set[str]) -> list[tuple[str, int]]:
    """(setting, line) of every place in a module that states a literal value under a setting's name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [(a.arg, node.lineno) for a, d in pairs if a.arg in settings and is_literal(d)]
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                        and item.target.id in settings and is_literal(item.value):
                    found.append((item.target.id, item.lineno))
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func == "add_argument":
                flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                dest = next((k.value.value for k in node.keywords if k.arg == "dest"
                             and isinstance(k.value, ast.Constant)), None)
                dest = dest or next((f.lstrip("-").replace("-", "_") for f in flags if f.startswith("--")), None)
                if dest in settings and any(k.arg == "default" and is_literal(k.value) for k in node.keywords):
                    found.append((dest, node.lineno))
            else:
                found += [(k.arg, node.lineno) for k in node.keywords if k.arg in settings and is_literal(k.value)]
        elif isinstance(node, ast.Dict):  # a dict of parameters: two or more of its keys are settings
            keyed = [(k.value, v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)
                     and k.value in settings]
            if len(keyed) > 1:
                found += [(k, node.lineno) for k, v in keyed if is_literal(v)]
    return found


def keyed_reads(tree: ast.AST, settings: set[str]) -> list[int]:
    """Lines that read a setting out of a mapping by its name: `p["max_length"]`, `params.get("hosts")`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in settings:
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in settings:
            found.append(node.lineno)
    return found


def syspath_insertions(root: Path) -> list[str]:
    """`sys.path.insert/append/extend` calls and `sys.path` assignments in every Python file of the checkout."""
    found = []
    for part in EVERYWHERE:
        for path in sorted((root / part).rglob("*.py")) if (root / part).is_dir() else ():
            if "__pycache__" in path.parts or ".venv" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("insert", "append", "extend") else \
                    node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
                if isinstance(target, ast.Attribute) and target.attr == "path" \
                        and isinstance(target.value, ast.Name) and target.value.id == "sys":
                    found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def repeated_blocks(texts: dict[str, str]) -> list[tuple[int, str, str]]:
    """(lines, place, other place) of every block of >= WINDOW consecutive identical significant lines found in
    two places, longest first."""
    lines: dict[str, list[tuple[int, str]]] = {}
    for rel, text in texts.items():
        kept = []
        for n, raw in enumerate(text.splitlines(), 1):
            code = raw.strip()
            if code and not code.startswith("#") and not re.fullmatch(r"[\]\)\}:,]+", code):
                kept.append((n, code))
        lines[rel] = kept
    seen: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for rel, kept in lines.items():
        for i in range(len(kept) - WINDOW + 1):
            seen[hash(tuple(c for _, c in kept[i:i + WINDOW]))].append((rel, i))
    runs: dict[tuple, list[int]] = defaultdict(list)  # (file a, file b, index offset) -> window starts in a
    for places in seen.values():
        for x in range(len(places)):
            for y in range(x + 1, min(len(places), x + 20)):
                (ra, ia), (rb, ib) = places[x], places[y]
                if (ra, ia) != (rb, ib) and not (ra == rb and abs(ia - ib) < WINDOW):
                    runs[(ra, rb, ib - ia)].append(ia)
    blocks = []
    for (ra, rb, offset), starts in runs.items():
        starts.sort()
        first = prev = starts[0]
        for start in starts[1:] + [None]:
            if start is not None and start == prev + 1:
                prev = start
                continue
            size = prev - first + WINDOW
            a0, a1 = lines[ra][first][0], lines[ra][prev + WINDOW - 1][0]
            b0, b1 = lines[rb][first + offset][0], lines[rb][prev + offset + WINDOW - 1][0]
            blocks.append((size, f"{ra}:{a0}-{a1}", f"{rb}:{b0}-{b1}"))
            if start is not None:
                first = prev = start
    return sorted(blocks, reverse=True)


def exception_classes(trees: dict[str, ast.Module]) -> dict[str, str]:
    """Product exception classes (a base named *Error, *Exception, Exception, or another such class) ->
    module."""
    found: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for rel, tree in trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in found:
                    bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                    if any(b.endswith(("Error", "Exception", "Interrupt")) or b in found for b in bases):
                        found[node.name], changed = rel, True
    return found


def retry_words(trees: dict[str, ast.AST]) -> dict[str, int]:
    """How often each name for "can a retry help?" is an identifier of the product's code (a variable, attribute,
    parameter or keyword: prose in comments and docstrings does not count)."""
    counts = dict.fromkeys(RETRY_WORDS, 0)
    for tree in trees.values():
        for node in ast.walk(tree):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.arg if isinstance(node, (ast.arg, ast.keyword)) else None)
            if name in counts:
                counts[name] += 1
    return counts


def tool_findings(root: Path, tool: list[str]) -> int | str:
    """The number of findings a linter or type checker reports on the product, or why none was counted."""
    try:
        proc = subprocess.run([sys.executable, "-m", *tool, *PRODUCT], cwd=root, capture_output=True, text=True,
                              timeout=600)
    except subprocess.TimeoutExpired:
        return "timed out"
    said = proc.stdout + proc.stderr
    if "No module named" in said:
        return "not installed"
    if tool[0] == "ruff":
        return 0 if proc.returncode == 0 else len([ln for ln in proc.stdout.splitlines() if re.match(r"\S+:\d+:\d+: ", ln)])
    found = re.search(r"Found (\d+) errors?", said)
    return int(found.group(1)) if found else (0 if proc.returncode == 0 else said.strip()[-200:])


def measure(root: Path, tools: bool = True) -> dict:
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
    rels = {path.relative_to(root).as_posix(): tree for path, tree in trees.items()}
    texts = {path.relative_to(root).as_posix(): path.read_text() for path in trees}
    names = {module_name(rel): rel for rel in rels}
    packages: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    graph: dict[str, set[str]] = defaultdict(set)
    private = []
    for name, rel in names.items():
        packages[package_of(name, set(names))][0] += 1
        packages[package_of(name, set(names))][1] += sizes[rel]
        for target, imported, line in imports(rels[rel], name, rel.endswith("__init__.py"), set(names)):
            if target != name:
                graph[name].add(target)
            if imported.startswith("_") and not imported.startswith("__"):
                private.append(f"{rel}:{line} {target}.{imported}")
    settings = flow_parameters(rels)
    places: dict[str, list[str]] = defaultdict(list)
    for rel, tree in rels.items():
        for setting, line in setting_values(tree, set(settings)):
            places[setting].append(f"{rel}:{line}")
    keyed = {rel: lines for rel, tree in rels.items() if not rel.startswith("src/")
             and (lines := keyed_reads(tree, set(settings)))}
    outside = {rel: found for rel, found in branches.items() if not rel.startswith(STORE)}
    exceptions = exception_classes(rels)
    long_lines = sum(1 for t in texts.values() for ln in t.splitlines() if len(ln) > 100)
    total = sum(sizes.values())
    return {"modules": len(sizes), "lines": total, "median": statistics.median(sizes.values()),
            "largest": max(sizes.items(), key=lambda kv: kv[1]), "sizes": sizes, "longest": longest[:10],
            "branches": branches, "branches_outside_store": outside, "public": public, "documented": documented,
            "packages": {k: {"modules": v[0], "lines": v[1]} for k, v in sorted(packages.items())},
            "cycles": cycles(graph), "private_imports": private,
            "settings": {k: places.get(k, []) for k in settings}, "keyed_reads": keyed,
            "syspath": syspath_insertions(root), "repeated": repeated_blocks(texts),
            "exceptions": exceptions, "retry_words": retry_words(trees),
            "long_lines": long_lines, "long_lines_pct": round(100 * long_lines / max(1, total), 1),
            "over_60": sum(1 for lines, _ in longest if lines > 60),
            "ruff": tool_findings(root, ["ruff", "check", "--quiet"]) if tools else "not run",
            "mypy": tool_findings(root, ["mypy"]) if tools else "not run"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--markdown", action="store_true", help="print the per-module table too")
    ap.add_argument("--json", type=Path, help="write every measure here too")
    ap.add_argument("--no-tools", action="store_true", help="skip ruff and mypy")
    args = ap.parse_args()
    m = measure(args.root, tools=not args.no_tools)
    print(f"{m['modules']} product modules, {m['lines']} lines; median {m['median']:g} lines, largest "
          f"{m['largest'][0]} ({m['largest'][1]} lines)")
    for package, size in m["packages"].items():
        print(f"  {package}: {size['modules']} modules, {size['lines']} lines")
    print(f"10 longest functions ({m['over_60']} over 60 lines):")
    for lines, name in m["longest"]:
        print(f"  {lines:4d}  {name}")
    print(f"import cycles: {len(m['cycles'])}")
    for group in m["cycles"]:
        print(f"  {len(group)} modules: {', '.join(group)}")
    print(f"private names imported from another module: {len(m['private_imports'])}")
    for place in m["private_imports"]:
        print(f"  {place}")
    repeated = {k: v for k, v in m["settings"].items() if len(v) > 1}
    print(f"settings (the extract flow's {len(m['settings'])} parameters) stated in more than one place: "
          f"{len(repeated)}; {sum(len(v) for v in m['settings'].values())} places in all")
    for name, places in sorted(repeated.items(), key=lambda kv: -len(kv[1])):
        print(f"  {name}: {len(places)} ({', '.join(places[:6])}{' ...' if len(places) > 6 else ''})")
    print(f"settings read by their name out of a mapping (p[\"max_length\"], .get(\"hosts\")) in the orchestrator: "
          f"{sum(len(v) for v in m['keyed_reads'].values())}")
    for rel, lines in sorted(m["keyed_reads"].items()):
        print(f"  {rel}: lines {', '.join(map(str, lines))}")
    total = sum(len(v) for v in m["branches"].values())
    outside = sum(len(v) for v in m["branches_outside_store"].values())
    print(f"places that branch on local vs s3:// ({total}; {outside} outside the store package):")
    for rel, lines in sorted(m["branches"].items()):
        print(f"  {rel}: lines {', '.join(map(str, lines))}")
    print(f"sys.path insertions: {len(m['syspath'])}" + "".join(f"\n  {p}" for p in m["syspath"]))
    print(f"repeated blocks (>= {WINDOW} identical lines in two places): {len(m['repeated'])}")
    for lines, a, b in m["repeated"][:10]:
        print(f"  {lines:3d}  {a}  ~  {b}")
    modules_with = len(set(m["exceptions"].values()))
    print(f"exception classes: {len(m['exceptions'])} in {modules_with} modules; names for 'can a retry help?': "
          + ", ".join(f"{w} ({n})" for w, n in m["retry_words"].items() if n))
    print(f"lines over 100 characters: {m['long_lines']} ({m['long_lines_pct']}%)")
    print(f"ruff findings: {m['ruff']}; mypy findings: {m['mypy']}")
    print(f"public definitions with a docstring: {m['documented']} of {m['public']} "
          f"({100 * m['documented'] / max(1, m['public']):.0f}%)")
    if args.markdown:
        print("\n| module | lines |\n|---|---|")
        for rel, n in sorted(m["sizes"].items(), key=lambda kv: -kv[1]):
            print(f"| {rel} | {n} |")
    if args.json:
        args.json.write_text(json.dumps(m, indent=1, default=list))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
