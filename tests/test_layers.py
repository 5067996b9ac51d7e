"""The folders are the layers: each package imports only the layers below it, and no module
imports itself back through others (docs/internals.md, "Layers").

Every import counts, at module level, inside functions and under TYPE_CHECKING alike: an
import hidden in a function is still an arrow between the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("twinkled", "scheduler", "tinker_shim", "openai_shim", "anthropic_shim",
            "twinkle_sdk")

# layer -> the layers it may import (itself included). Longest prefix names a module's layer.
ALLOWED: dict[str, set[str]] = {
    "twinkled.protocol": set(),
    "scheduler": set(),
    "twinkled.engine": {"twinkled.protocol"},
    "twinkled.store": {"twinkled.protocol"},
    "twinkled.workers": {"twinkled.protocol", "twinkled.engine"},
    "twinkled.core": {"twinkled.protocol", "twinkled.store", "twinkled.workers", "scheduler"},
    "tinker_shim": {"twinkled.protocol", "twinkled.core"},
    "openai_shim": {"twinkled.protocol", "twinkled.core", "tinker_shim"},
    # A thin translation over the OpenAI face's text path (openai_shim/sampling.py).
    "anthropic_shim": {"twinkled.protocol", "twinkled.core", "tinker_shim", "openai_shim"},
    "twinkled.server": {"twinkled.protocol", "twinkled.engine", "twinkled.store",
                        "twinkled.workers", "twinkled.core", "scheduler", "tinker_shim",
                        "openai_shim", "anthropic_shim"},
    "twinkled": {"twinkled.server"},  # the package itself: __main__
    "twinkle_sdk": {"twinkled.protocol", "twinkled.engine"},  # the engine in local mode
}


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = f
    return found


MODULES = modules()


def layer(module: str) -> str:
    return max((name for name in ALLOWED if module == name or module.startswith(name + ".")),
               key=len)


def imports(module: str) -> set[str]:
    """The project modules `module` imports (the deepest existing module of each name)."""
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: None if is_pkg else -1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            # importing a module runs its packages' __init__ first: no arrow of its own
            if name and name != module and not module.startswith(name + "."):
                targets.add(name)
    return targets


GRAPH = {m: imports(m) for m in MODULES}


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, targets in sorted(GRAPH.items()):
        mine = layer(module)
        for target in sorted(targets):
            theirs = layer(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_layer_table_forms_no_cycle():
    seen: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, "layer cycle: " + " -> ".join(path + [name])
        for below in ALLOWED[name]:
            visit(below, path + [name])

    for name in ALLOWED:
        visit(name, [])
    assert not seen


def test_no_module_imports_itself_back():
    """Tarjan's strongly connected components over every import: each must be one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            connect(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_layer_rule_sees_a_wrong_arrow(tmp_path):
    """The checker itself: a store module importing the core is caught."""
    module = "twinkled.store.runs"
    assert layer(module) == "twinkled.store"
    assert layer("twinkled.core.service") not in ALLOWED[layer(module)]
    assert layer("twinkled.protocol.errors") in ALLOWED[layer(module)]
