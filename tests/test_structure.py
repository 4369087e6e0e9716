"""The shape of the package: no import cycles between k3 modules, and no k3 file over 700 lines.

The import graph is read from the source with `ast` (nothing is imported). `import a.b` and `from a import b` point
at module a.b when it exists, else at the package a; relative imports are resolved; parent packages that Python runs
first are not edges of their own (`k3/__init__.py` is lazy and imports only leaves). Two graphs:

- module level: the imports that run when a module loads (also in module-level `try` / `if` blocks; not in
  functions or classes, not under `if TYPE_CHECKING:`). A cycle here is an import-order bug waiting to happen.
- layering: every import, also the lazy ones inside functions. A cycle here means two modules each need the other
  (one concept split across layers); the lower one should take what it needs as an argument, or the shared part
  moves down. The only upward imports allowed are listed in UPWARD_IMPORTS, each with its reason."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 700

TOO_LONG_ALLOWED: set = set()


# lazy imports from a lower layer into a higher one, kept on purpose: (importer, imported) -> why
UPWARD_IMPORTS = {
    ("k3.model", "k3.checkpoint"): "K3ForCausalLM.from_pretrained / save_pretrained: the delegates users expect "
                                   "(k3.checkpoint builds and saves models; the methods import it when called)",
    ("k3.multimodal", "k3.checkpoint.multimodal"): "K3ForConditionalGeneration.from_pretrained / save_pretrained: "
                                                   "the same delegates for the multimodal model",
    ("k3.generation.generate", "k3.generation.speculative"): "generate(speculative='mtp') hands the request to "
                                                             "the speculative loop, which reuses generate's setup "
                                                             "and decoding",
}
LAYERING_EXEMPT_PACKAGES: tuple = ()


def k3_modules() -> dict[str, str]:
    """{dotted module name: path relative to the repository root} for every k3 source file."""
    mods = {}
    for dp, dns, fns in os.walk(os.path.join(ROOT, "k3")):
        dns[:] = sorted(d for d in dns if d != "__pycache__")
        for fn in sorted(fns):
            if fn.endswith(".py"):
                rel = os.path.relpath(os.path.join(dp, fn), ROOT).replace(os.sep, "/")
                parts = rel[:-3].split("/")
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                mods[".".join(parts)] = rel
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _all_imports(body):
    """Every Import / ImportFrom node, also inside functions and classes (not under `if TYPE_CHECKING:`)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _all_imports(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                yield from _all_imports(getattr(node, field, None) or [])


def _module_level_imports(body):
    """The Import / ImportFrom nodes run when the module loads (not in functions, classes, TYPE_CHECKING)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level_imports(part)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            yield from _module_level_imports(node.body)


def import_graph(lazy: bool = False) -> dict[str, set[str]]:
    """{k3 module: the k3 modules it imports at module level} (lazy=True: also inside functions and classes)."""
    mods = k3_modules()
    graph: dict[str, set[str]] = {}
    for name, rel in mods.items():
        is_pkg = rel.endswith("__init__.py")
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=rel)
        deps = set()
        for node in (_all_imports if lazy else _module_level_imports)(tree.body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    pkg = ".".join(base + ([node.module] if node.module else []))
                else:
                    pkg = node.module
                targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in mods else pkg for a in node.names]
            for t in targets:
                while t and t not in mods:       # `import k3.ops.x` of a name inside a module: the module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected component with more than one module."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    cycles = []
    for comp in comps:                           # a shortest cycle through the component's first module
        start = min(comp)
        prev, frontier = {start: None}, [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w == start:
                        found = v
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path, v = [start], found
        while v is not None and v != start:
            path.insert(1, v)
            v = prev[v]
        cycles.append(path + [start])
    return cycles


def test_graph_reader_sees_what_it_should():
    g = import_graph()
    assert "k3.knobs" in g["k3.model"]                      # from k3 import knobs: the submodule
    assert "k3.config" in g["k3.model"]
    assert all(d.startswith("k3") for deps in g.values() for d in deps)
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles between k3 modules (import inside the function that needs it, or move " \
        "the shared part down a layer):\n" + "\n".join(" -> ".join(c) for c in cycles)


def _in(pkg: str, mod: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def test_layering_has_no_cycles_counting_lazy_imports():
    graph = import_graph(lazy=True)
    for (a, b), why in UPWARD_IMPORTS.items():
        assert b in graph[a], f"stale UPWARD_IMPORTS entry {a} -> {b} ({why}): drop it"
        graph[a].discard(b)
    for pkg in LAYERING_EXEMPT_PACKAGES:
        for a in graph:
            if _in(pkg, a):
                graph[a] = {b for b in graph[a] if not _in(pkg, b)}
    cycles = find_cycles(graph)
    assert not cycles, "k3 modules that import each other (also counting imports inside functions): let the " \
        "lower one take what it needs as an argument or move the shared part down:\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def test_no_file_over_700_lines():
    too_long, stale = [], []
    for rel in k3_modules().values():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES and rel not in TOO_LONG_ALLOWED:
            too_long.append(f"{rel} ({n} lines)")
        elif n <= MAX_LINES and rel in TOO_LONG_ALLOWED:
            stale.append(rel)
    assert not too_long, f"k3 files over {MAX_LINES} lines: split them by concern: {too_long}"
    assert not stale, f"now short enough: drop {stale} from TOO_LONG_ALLOWED"
