"""The layering of docs/architecture.md, checked on the source: every import statement of the package
(module level and inside functions, TYPE_CHECKING blocks included) becomes an edge; the graph must
have no cycle and none of the forbidden edges. A new cycle or a forbidden import fails here, naming
the file and line."""

import ast
from pathlib import Path

PKG_DIR = Path(__file__).resolve().parents[2] / "flexflow_sglang"
PKG = "flexflow_sglang"

#: the serving library: never imports a tool
LIBRARY = ("backend", "pd", "connector", "transfer", "tiers", "selector", "monitor", "topology", "config",
           "config_rules", "errors")
#: what `ls flexflow_sglang` may show besides the library: the one tools package, the shipped configs
#: and the compiled cores built in place
TOP_LEVEL_EXTRA = ("tools", "configs", "__init__")
#: tools on top of the library (benchmarks, labs, simulator, CLI, CPU stand-ins, helpers, data)
TOOLS = ("tools",)
#: what each part must not import (third-party roots)
NO_THIRD_PARTY = {"selector": ("torch", "sglang"), "topology": ("torch", "sglang"), "monitor": ("torch", "sglang"),
                  "config": ("torch", "sglang"), "config_rules": ("torch", "sglang"), "errors": ("torch", "sglang"),
                  "connector": ("sglang",), "transfer": ("sglang",)}


def _modules():
    for path in sorted(PKG_DIR.rglob("*.py")):
        rel = path.relative_to(PKG_DIR.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path, path.name == "__init__.py"


def _imports(mod: str, path: Path, is_pkg: bool):
    """(target, lineno) for every import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                root = base[: len(base) - (node.level - 1)]
                target = ".".join(root + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, node.lineno
            for a in node.names:  # `from . import x` / `from .pkg import submodule`
                yield f"{target}.{a.name}", node.lineno


def _graph():
    mods = {m: (p, pkg) for m, p, pkg in _modules()}
    edges, third = {}, {}
    for m, (p, pkg) in mods.items():
        out = edges.setdefault(m, {})
        for target, line in _imports(m, p, pkg):
            if target.startswith(PKG + ".") or target == PKG:
                # the longest known module the name refers to (a.b.func -> a.b); a name under the
                # root that is no .py file is the compiled core (csrc/): a leaf of its own
                t = target
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t == PKG and target != PKG:
                    head = ".".join(target.split(".")[:2])
                    t = head if head.split(".")[1].startswith("_") else t
                # a module's own parent packages run before it anyway: not an edge of its making
                if t and t != m and not m.startswith(t + "."):
                    out.setdefault(t, line)
            else:
                third.setdefault(m, []).append((target.split(".")[0], line))
    return mods, edges, third


def _part(mod: str) -> str:
    return mod[len(PKG) + 1:].split(".")[0]


def test_there_is_no_import_cycle():
    mods, edges, _ = _graph()
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def strong(v):  # Tarjan, iterative enough for this size
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                strong(w)
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
                sccs.append(sorted(comp))

    for v in mods:
        if v not in index:
            strong(v)
    detail = [" <-> ".join(c) + ": " + "; ".join(f"{a} imports {b} (line {edges[a][b]})" for a in c for b in c
                                                if b in edges.get(a, {})) for c in sccs]
    assert not sccs, "import cycles:\n" + "\n".join(detail)


def test_the_library_never_imports_a_tool():
    _, edges, _ = _graph()
    bad = [f"{a} imports {b} (line {line})" for a, out in edges.items() if _part(a) in LIBRARY
           for b, line in out.items() if _part(b) in TOOLS]
    assert not bad, "\n".join(bad)


def test_lower_layers_do_not_import_torch_or_sglang():
    mods, _, third = _graph()
    bad = [f"{m} imports {root} (line {line})" for m, found in third.items()
           for root, line in found if root in NO_THIRD_PARTY.get(_part(m), ())]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_function_level_and_relative_imports():
    # guard against a checker that passes because it parses nothing
    mods, edges, third = _graph()
    assert len(mods) > 60
    assert f"{PKG}.connector" in edges[f"{PKG}.backend.cache"]  # a function-level import
    assert f"{PKG}._selector_core" in edges[f"{PKG}.selector.selector"]  # the compiled core, a leaf
    assert any(root == "torch" for root, _ in third[f"{PKG}.connector.layout"])


def test_the_top_level_shows_the_architecture_and_nothing_else():
    # the serving library's parts and the one tools package; a new top-level module or package is
    # either library (add it to LIBRARY and to docs/architecture.md) or a tool (put it under tools/)
    found = {p.stem if p.suffix == ".py" else p.name for p in PKG_DIR.iterdir()
             if not p.name.startswith((".", "_selector_core", "_copy_kernels", "__pycache__"))
             and (p.suffix == ".py" or p.is_dir())}
    unknown = sorted(found - set(LIBRARY) - set(TOP_LEVEL_EXTRA))
    assert not unknown, f"flexflow_sglang/ holds {unknown}: neither library nor tools/"
