#!/usr/bin/env python3
"""Find import cycles between modules, in every crate of the workspace and in bench/.

A Rust module may use its own parent and children (a directory module and its files are one
idea); among siblings — files of one directory, a directory counted with everything under it —
uses must not go round. Python modules in one directory likewise. Prints each cycle and exits 1
if there is one.

usage: scripts/import-cycles.py [crate source directories…]   (default: the workspace's)
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CRATES = ["src", "core/src", "native/src", "quota/src", "cli/src", "testbed/src", "testkit/src"]

PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_GROUP = re.compile(r"\buse\s+(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*)\};", re.S)


def strip_comments(text):
    """The code only: no comments, and no test module (`#[cfg(test)] mod …` to the file's end)."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    tests = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    return text[: tests.start()] if tests else text


def crate_modules(src):
    """Module path (tuple) -> file, for every .rs file of a crate."""
    modules = {}
    for f in src.rglob("*.rs"):
        rel = f.relative_to(src).with_suffix("").parts
        if rel[-1] in ("mod", "lib", "main"):
            rel = rel[:-1]
        if f.name in ("lib.rs", "main.rs") and f.parent != src:
            continue
        if len(rel) and rel[0] == "bin":
            continue
        # Test modules (`#[cfg(test)] mod tests;`) use what they test, like inline ones.
        if "tests" in rel:
            continue
        modules[tuple(rel)] = f
    return modules


def resolve(base, module, kind, rest, modules):
    """The module a path `kind::rest` written in `module` names (the deepest one that exists)."""
    if kind == "crate":
        path = ()
    elif kind == "self":
        path = module
    else:
        path = module
        while rest and rest[0] == "super":
            rest = rest[1:]
            path = path[:-1]
        path = path[:-1] if path else path
    full = path + tuple(rest)
    while full and full not in modules:
        full = full[:-1]
    return full


def references(module, text, modules):
    text = strip_comments(text)
    found = set()
    for kind, head, group in USE_GROUP.findall(text):
        head_parts = [p for p in head.split("::") if p]
        for item in re.split(r",", group):
            item = item.strip().split(" as ")[0]
            parts = [p for p in re.split(r"::|\{|\}", item) if p.strip()]
            if parts:
                found.add(resolve(None, module, kind, head_parts + [parts[0].strip()], modules))
    for kind, rest in PATH.findall(text):
        parts = [p for p in rest.split("::") if p]
        if kind == "super":
            parts = ["super"] + parts
            kind = "super"
            # `super::super::x`: resolve() walks the extra supers.
            parts = parts[1:]
            found.add(resolve(None, module, "super", parts, modules))
        else:
            found.add(resolve(None, module, kind, parts, modules))
    return found


def sibling_edges(edges):
    """Edges between siblings: each endpoint lifted to the child of their common parent."""
    out = set()
    for a, b in edges:
        n = 0
        while n < len(a) and n < len(b) and a[n] == b[n]:
            n += 1
        if n == len(a) or n == len(b):
            continue  # one contains the other: a parent and its descendant
        out.add((a[: n + 1], b[: n + 1]))
    return out


def cycles(nodes, edges):
    """Strongly connected components of more than one node (Tarjan)."""
    graph = {n: set() for n in nodes}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def rust_cycles(src):
    modules = crate_modules(src)
    edges = set()
    for module, f in modules.items():
        for target in references(module, f.read_text(), modules):
            if target != module:
                edges.add((module, target))
    return [
        [src.relative_to(ROOT).as_posix() + "/" + ("/".join(m) or "lib") for m in comp]
        for comp in cycles(set(modules), sibling_edges(edges))
    ]


def python_cycles(directory):
    files = {f.stem: f for f in directory.glob("*.py")}
    edges = set()
    for name, f in files.items():
        for line in f.read_text().splitlines():
            m = re.match(r"\s*(?:from\s+(\w+)\s+import|import\s+([\w, ]+))", line)
            if not m:
                continue
            targets = [m.group(1)] if m.group(1) else [t.strip() for t in m.group(2).split(",")]
            for t in targets:
                if t in files and t != name:
                    edges.add(((name,), (t,)))
    return [
        [directory.relative_to(ROOT).as_posix() + "/" + c[0] + ".py" for c in comp]
        for comp in cycles({(n,) for n in files}, edges)
    ]


def main():
    dirs = sys.argv[1:] or CRATES
    found = []
    for d in dirs:
        found += rust_cycles(ROOT / d)
    found += python_cycles(ROOT / "bench")
    for comp in found:
        print("import cycle: " + " <-> ".join(comp))
    if found and "-v" not in sys.argv:
        print("(the edges: scripts/import-cycles.py -v)")
    if found:
        sys.exit(1)
    print("no import cycles")


if __name__ == "__main__":
    main()
