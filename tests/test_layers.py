"""The layers of src/rlvr, read from its imports (every `import`, module-level or inside a function).

The rules are written once, here, each with the reason it exists; there is no exception list. A
module that breaks one is named with its line, and the fix is to move code, never to list it:
an import that climbs a layer means the code belongs higher, or the caller should pass in what it
needs (a callback, a function, plain values).

Components are the top-level modules and packages of rlvr. Lowest first; a component may import
its own layer and the layers below. Inside one component anything goes, except import circles.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"


@dataclass(frozen=True)
class Layer:
    name: str
    components: tuple[str, ...]
    why: str
    independent: bool = False  # components of this layer may not import each other


LAYERS = (
    Layer(
        "foundation",
        (
            "errors",
            "records",
            "registry",
            "yaml_types",
            "devices",
            "hub",
            "precision",
            "allocator",
            "optim",
        ),
        "the shared vocabulary (records, errors, names) and hardware facts: all may use them",
    ),
    Layer(
        "pure",
        ("algorithms", "sandbox"),
        "advantages and losses are tensor maths, the sandbox runs code: neither knows the run",
        independent=True,
    ),
    Layer("config", ("config",), "one typed config read by everything above, asking nothing above"),
    Layer(
        "observe",
        ("observe",),
        "observers read metrics, records and config; the loop calls them, they never call it",
    ),
    Layer(
        "text",
        ("envs", "verifiers"),
        "envs and verifiers see text (messages in, rewards out), never a model or a generator",
    ),
    Layer(
        "inputs",
        ("tasks", "models"),
        "what a run starts from: task rows (from config and envs) and weights, apart",
        independent=True,
    ),
    Layer(
        "generation",
        ("rollout", "serve"),
        "the engine plays envs with a model; servers sample over HTTP; neither knows the trainer",
    ),
    Layer("build", ("build", "plan"), "turns a config into the objects the trainer uses"),
    Layer(
        "trainer",
        ("train", "scale", "evaluate"),
        "the RL step and its scaled and evaluating variants, on top of everything they drive",
    ),
    Layer("offline", ("offline",), "SFT, DPO, distillation and reward models reuse the trainer"),
    Layer(
        "commands",
        ("authoring", "pipeline", "review", "sycophancy", "evaluate_cli", "export"),
        "what a user runs: each composes the layers below and is imported by none of them",
    ),
    Layer(
        "cli", ("cli",), "the entry point: parses arguments, imports anything, is imported by none"
    ),
)

LAYER_OF = {c: i for i, layer in enumerate(LAYERS) for c in layer.components}


@dataclass(frozen=True)
class Edge:
    importer: str  # rlvr.a.b
    path: Path
    line: int
    imported: str  # the rlvr module it names

    def where(self) -> str:
        return f"{self.path.relative_to(SRC.parent)}:{self.line}"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__)."""
    found = {}
    for path in sorted((SRC / "rlvr").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _named(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The rlvr modules an import statement names (`from rlvr.a import b` names rlvr.a.b when b
    is a module, else rlvr.a)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")[
                : len(module.split(".")) - node.level + (1 if is_package else 0)
            ]
            prefix = ".".join([*base, *([node.module] if node.module else [])])
        else:
            prefix = node.module or ""
        names = [
            f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names
        ]
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]  # `import rlvr.a.b.Thing`-style: its module
        if name in MODULES and name != module and name.startswith("rlvr."):
            yield name


def _edges() -> list[Edge]:
    edges: dict[tuple[str, int, str], Edge] = {}  # one per statement and module named
    for module, (path, is_package) in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name in _named(module, is_package, node):
                    edges[module, node.lineno, name] = Edge(module, path, node.lineno, name)
    return list(edges.values())


EDGES = _edges()


def component(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_every_component_has_a_layer() -> None:
    """A new top-level module or package must be placed, so that the rules below cover it."""
    missing = sorted({component(m) for m in MODULES} - set(LAYER_OF) - {""})
    assert not missing, (
        f"rlvr components without a layer: {missing}; add each to LAYERS in {Path(__file__).name}"
    )


def test_no_import_climbs_a_layer() -> None:
    broken = []
    for e in EDGES:
        src, dst = component(e.importer), component(e.imported)
        if src == dst or src not in LAYER_OF or dst not in LAYER_OF:
            continue
        low, high = LAYERS[LAYER_OF[src]], LAYERS[LAYER_OF[dst]]
        if LAYER_OF[dst] > LAYER_OF[src]:
            broken.append(
                f"{e.where()}: {e.importer} imports {e.imported}: layer '{low.name}' ({src}) may not "
                f"import the higher layer '{high.name}' ({dst}): {low.name}: {low.why}"
            )
        elif LAYER_OF[dst] == LAYER_OF[src] and low.independent:
            broken.append(
                f"{e.where()}: {e.importer} imports {e.imported}: {src} and {dst} are independent "
                f"in layer '{low.name}': {low.why}"
            )
    assert not broken, "\n".join(broken)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in EDGES:
        graph[e.importer].add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    scc.append(member)
                    if member == node:
                        break
                if len(scc) > 1:
                    found.append(sorted(scc))
    return found


def test_no_import_circles() -> None:
    """A circle, even through a function-level import, means two modules are one: neither can be
    understood, tested or moved alone, and the lazy import that hides it is an ordering bug waiting."""
    messages = []
    for scc in _cycles():
        inside = set(scc)
        lines = [
            f"  {e.where()}: {e.importer} imports {e.imported}"
            for e in EDGES
            if e.importer in inside and e.imported in inside
        ]
        messages.append(f"import circle between {', '.join(scc)}:\n" + "\n".join(lines))
    assert not messages, "\n".join(messages)


def test_the_reader_sees_function_level_imports(tmp_path: Path) -> None:
    """The rules hold for lazy imports too: the reader must find an import inside a function."""
    source = "def f():\n    from rlvr.train.loop import train\n    return train\n"
    tree = ast.parse(source)
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [list(_named("rlvr.envs.base", False, n)) for n in found] == [["rlvr.train.loop"]]


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: layer.name)
def test_each_layer_says_why(layer: Layer) -> None:
    assert layer.why and layer.components
