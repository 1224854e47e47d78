"""The package's import graph: no circles, and no layer imports one above it.

Every ``import`` and ``from ... import`` in ``minfer/`` counts, those inside functions too: a lazy
import upward is still a dependency upward. The layers, from the ground floor up:

    ebnf < ebnf_regex < structured_grammar < structured_limits < structured_outputs < harmony < spec_config
        < kv_events_config < leaf modules (config, sampling_params, pooling_params, outputs, reasoning, version)
        < pooling_outputs < beam_search < distributed < kernels < ops < model < engine
        < llm, engine_args, eval_ppl < server, train < ray < benchmark < cli

``ray`` (Ray Data's predictor, Ray Serve's application) sits above ``server``: it builds the server's app.
"""
from __future__ import annotations

import ast
from pathlib import Path

import minfer

ROOT = Path(minfer.__file__).parent
RANK = {
    "ebnf": -1, "ebnf_regex": -0.9, "structured_grammar": -0.8, "structured_limits": -0.7, "structured_outputs": -0.5,
    "harmony": -0.2,
    "config": 0, "sampling_params": 0, "outputs": 0, "reasoning": 0, "version": 0, "spec_config": -0.1,
    "kv_events_config": -0.05,
    "pooling_params": 0, "pooling_outputs": 0.1, "beam_search": 0.5,
    "distributed": 1, "lora": 1.2, "kernels": 1.5, "ops": 2, "model": 3, "engine": 4,
    "llm": 5, "engine_args": 5, "eval_ppl": 6,
    "server": 7, "train": 7, "ray": 7.5, "benchmark": 8, "cli": 9, "__main__": 10, "__init__": 10,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Modules of minfer that ``path`` imports (relative imports resolved)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("minfer")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("minfer"):
                found.add(mod)
                found |= {f"{mod}.{a.name}" for a in node.names}  # `from pkg import module`
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        graph[name] = {m for m in _imports(path) if m in files and m != name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_layer():
    assert {_layer(m) for m in _graph()} <= set(RANK)


def test_nothing_imports_upward():
    upward = sorted(f"{a} -> {b}" for a, deps in _graph().items() for b in deps
                    if _layer(a) != _layer(b) and RANK[_layer(b)] >= RANK[_layer(a)])
    assert not upward, "imports that go up a layer (or sideways between layers):\n" + "\n".join(upward)


def test_model_and_kernels_do_not_know_the_engine():
    graph = _graph()
    for module, deps in graph.items():
        layer = _layer(module)
        if layer in ("kernels", "ops", "model"):
            assert not {d for d in deps if _layer(d) == "engine"}, module
        if layer == "model":
            assert not {d for d in deps if _layer(d) == "kernels"}, f"{module} calls kernels directly, not through ops"


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
