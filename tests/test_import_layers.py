"""The package's floors import only downwards, and no module imports itself round a cycle.

Read from the sources with ``ast`` (nothing of ``mc2`` is imported): every import of an mc2
module, at module level or inside a function, absolute (``import mc2.x.y``, ``from mc2.x import
y``) or relative (``from ..x import y``), and ``importlib.import_module`` with a literal name.
``from pkg import name`` is an import of ``pkg.name`` when that is a module, else of ``pkg``
(its ``__init__``). A package's ``__init__`` is a module of its own; a submodule is not taken to
import its parent package merely because Python runs the parent's ``__init__`` first, so a
submodule and its package form a cycle only when each really names the other.

The floors, bottom to top::

    mc2.device                         clocks, streams: imports nothing else of mc2
    mc2.observation                    timelines, profiles: stands on mc2.device, never on
                                       the engine (the engine files its spans here)
    mc2.engine.transport < compute < decide < passes < autograd
                                       each floor imports its own floor and those below;
                                       nothing of the engine imports parallel, sim, layer,
                                       integrations, tools or the public face
    mc2.parallel, mc2.sim, mc2.layer, mc2.integrations, mc2.tools (anything)
    mc2, mc2.__main__, mc2.checkpoint  the public face (anything)
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT_PACKAGE = "mc2"

ENGINE_FLOORS = ("transport", "compute", "decide", "passes", "autograd")
PUBLIC_FACE = ("mc2", "mc2.__main__", "mc2.checkpoint")
# what the engine must not import (the public face imports everything, so it is above too)
ABOVE_ENGINE = ("mc2.parallel", "mc2.integrations", "mc2.layer", "mc2.forward_backward",
                "mc2.tools", "mc2.sim", *PUBLIC_FACE)


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``path``:``line``."""

    source: str
    target: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path}:{self.line})"


# ---------------------------------------------------------------------------------------------
# collecting the imports


def module_files(src: Path, package: str = ROOT_PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``src``: dotted name -> file (a package is its
    ``__init__.py``)."""
    modules: dict[str, Path] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The module an import of ``name`` loads: itself, or (a name not found, such as an
    attribute spelled as a module) its longest prefix that is a module."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) if parts else name


def _relative_base(module: str, is_package: bool, level: int) -> str:
    """The package ``from <level dots>`` names inside ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return package


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _import_module_target(call: ast.Call, module: str, is_package: bool) -> str | None:
    """``importlib.import_module("mc2.x")`` or ``import_module(".x", __name__)``."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not call.args:
        return None
    target = _literal(call.args[0])
    if target is None:
        return None
    if not target.startswith("."):
        return target
    anchor = call.args[1] if len(call.args) > 1 else next(
        (k.value for k in call.keywords if k.arg == "package"), None)
    if isinstance(anchor, ast.Name) and anchor.id in ("__name__", "__package__"):
        base = module if (is_package or anchor.id == "__name__") else module.rpartition(".")[0]
    else:
        base = _literal(anchor)
    if base is None:
        return None
    level = len(target) - len(target.lstrip("."))
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    rest = target.lstrip(".")
    return f"{base}.{rest}" if rest else base


def imports_of(module: str, path: Path, modules: dict[str, Path],
               root: Path | None = None) -> list[Edge]:
    """Every import of a module of the package made anywhere in ``path``'s source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    shown = str(path.relative_to(root)) if root else str(path)
    prefix = module.split(".")[0]
    edges: list[Edge] = []

    def add(target: str, node: ast.AST) -> None:
        if target == prefix or target.startswith(prefix + "."):
            resolved = _resolve(target, modules)
            if resolved != module:
                edges.append(Edge(module, resolved, shown, node.lineno))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _relative_base(module, is_package, node.level)
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                add(sub if sub in modules else origin, node)
        elif isinstance(node, ast.Call):
            target = _import_module_target(node, module, is_package)
            if target is not None:
                add(target, node)
    return edges


def import_graph(src: Path, package: str = ROOT_PACKAGE) -> tuple[dict[str, Path], list[Edge]]:
    modules = module_files(src, package)
    edges = [e for name, path in modules.items()
             for e in imports_of(name, path, modules, root=src.parent)]
    return modules, list(dict.fromkeys(edges))  # `from x import a, b`: one edge


# ---------------------------------------------------------------------------------------------
# checking them


def cycles(modules: list[str] | dict[str, Path], edges: list[Edge]) -> list[list[Edge]]:
    """Each strongly connected set of modules (Tarjan) of more than one, as the edges of the
    shortest cycle through its first module; :func:`cycle_sets` names all its members."""
    return [path for path, _, _ in _cycles(modules, edges)]


def cycle_sets(modules: list[str] | dict[str, Path], edges: list[Edge]) -> list[list[str]]:
    """The members of each strongly connected set of modules of more than one, sorted."""
    return [members for _, members, _ in _cycles(modules, edges)]


def _cycles(modules: list[str] | dict[str, Path],
            edges: list[Edge]) -> list[tuple[list[Edge], list[str], list[Edge]]]:
    out: dict[str, list[Edge]] = {m: [] for m in modules}
    for e in edges:
        out.setdefault(e.source, []).append(e)
        out.setdefault(e.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # iterative Tarjan (no recursion limit to meet)
        work = [(v, iter(out[v]))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, successors = work[-1]
            for e in successors:
                w = e.target
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(out[w])))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    components.append(component)

    for v in sorted(out):
        if v not in index:
            visit(v)

    found = []
    for component in components:
        members = set(component)
        if len(members) < 2:
            continue
        start = min(members)
        # breadth-first from start back to start, inside the component: the shortest cycle
        parent: dict[str, Edge] = {}
        frontier = [start]
        closing: Edge | None = None
        while frontier and closing is None:
            nxt = []
            for node in frontier:
                for e in sorted(out[node], key=lambda e: e.target):
                    if e.target not in members:
                        continue
                    if e.target == start:
                        closing = e
                        break
                    if e.target not in parent:
                        parent[e.target] = e
                        nxt.append(e.target)
                if closing:
                    break
            frontier = nxt
        assert closing is not None
        path = [closing]
        while path[0].source != start:
            path.insert(0, parent[path[0].source])
        found.append((path, sorted(members),
                      [e for e in edges if e.source in members and e.target in members]))
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def engine_floor(module: str) -> int | None:
    """The engine floor of ``module`` (0 = transport ... 4 = autograd; the engine package's own
    ``__init__`` sits on top of them), or None outside the engine."""
    if module == "mc2.engine":
        return len(ENGINE_FLOORS)
    for i, floor in enumerate(ENGINE_FLOORS):
        if _within(module, f"mc2.engine.{floor}"):
            return i
    return None


def layer_violations(edges: list[Edge]) -> list[tuple[Edge, str]]:
    """Every import that goes up a floor, with the rule it breaks."""
    found = []
    for e in edges:
        src, dst = e.source, e.target
        if _within(src, "mc2.device"):
            if not _within(dst, "mc2.device"):
                found.append((e, "mc2.device imports nothing else of mc2"))
        elif _within(src, "mc2.engine"):
            above = [top for top in ABOVE_ENGINE
                     if (_within(dst, top) if top != "mc2" else dst == "mc2")]
            if above:
                found.append((e, f"the engine imports nothing of {above[0]}"))
            elif engine_floor(dst) is not None and engine_floor(dst) > engine_floor(src):
                here, there = engine_floor(src), engine_floor(dst)
                names = ENGINE_FLOORS + ("engine",)
                found.append((e, f"engine floor {names[here]} imports the higher floor "
                                 f"{names[there]}"))
        elif _within(src, "mc2.observation"):
            if _within(dst, "mc2.engine") or dst in PUBLIC_FACE:
                found.append((e, "mc2.observation imports nothing of the engine"))
    return found


def _cycle_text(path: list[Edge], members: list[str] | None = None,
                inside: list[Edge] | None = None) -> str:
    loop = " -> ".join([e.source for e in path] + [path[0].source])
    text = loop + "\n" + "\n".join(f"    {e}" for e in path)
    if members and len(members) > len(path):
        text += ("\n  all on cycles with it: " + ", ".join(members) + "; their imports:\n"
                 + "\n".join(f"    {e}" for e in inside or []))
    return text


# ---------------------------------------------------------------------------------------------
# the real tree


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[Edge]]:
    return import_graph(SRC)


def test_the_collector_sees_the_tree(graph) -> None:
    """A collector that saw nothing would pass every check below: it must see what is there."""
    modules, edges = graph
    assert len(modules) > 40 and "mc2.engine.transport.comm" in modules, sorted(modules)
    pairs = {(e.source, e.target) for e in edges}
    assert len(pairs) > 60, len(pairs)
    # a public re-export, a lazy import(lib) and a deep relative or absolute one all show up
    assert ("mc2", "mc2.engine.autograd.ops") in pairs
    assert ("mc2", "mc2.checkpoint") in pairs, "importlib.import_module('.checkpoint') missed"
    assert any(_within(s, "mc2.engine.autograd") and _within(t, "mc2.engine.transport")
               for s, t in pairs)


def test_no_import_cycles(graph) -> None:
    modules, edges = graph
    found = _cycles(modules, edges)
    if found:
        pytest.fail("import cycles:\n" + "\n".join(_cycle_text(*c) for c in found), False)


def test_floors_import_only_downwards(graph) -> None:
    """The device alone; observation on it, never on the engine; the engine on both and
    below everything else; inside the engine transport < compute < decide < passes < autograd."""
    _, edges = graph
    found = layer_violations(edges)
    if found:
        pytest.fail("imports up a floor:\n" + "\n".join(f"  {e}  [{why}]" for e, why in found),
                    False)


def test_integrations_leave_transport_and_passes_to_the_engine(graph) -> None:
    """An integration is thin: it hands tokens, routing and experts to ``fused_expert*`` and
    asks the planner; it issues no collective of its own and runs no pass (batch overlap's
    scheduler and decision used to: now ``engine.autograd.layer_schedule`` and
    ``engine.decide.batch_split``)."""
    _, edges = graph
    found = [e for e in edges if _within(e.source, "mc2.integrations")
             and any(_within(e.target, f"mc2.engine.{floor}") for floor in ("transport", "passes"))]
    assert not found, "\n".join(map(str, found))


# ---------------------------------------------------------------------------------------------
# the checker itself: it finds what is planted


def _plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_checker_finds_a_planted_cycle_and_upward_imports(tmp_path: Path) -> None:
    src = _plant(tmp_path, {
        "mc2/__init__.py": "from mc2.engine.autograd.ops import call\n",
        "mc2/device/__init__.py": "",
        "mc2/device/clock.py": "import time\n",
        "mc2/engine/__init__.py": "",
        "mc2/engine/transport/__init__.py": "",
        "mc2/engine/transport/comm.py": """
            from ...device import clock
            def late():
                from ..decide import plan    # upward, hidden in a function
                return plan
        """,
        "mc2/engine/decide/__init__.py": "",
        "mc2/engine/decide/plan.py": "from mc2.engine.transport.comm import late\n",
        "mc2/engine/autograd/__init__.py": "from . import ops\n",
        "mc2/engine/autograd/ops.py": "from .staged import step\nfrom ..transport import comm\n",
        "mc2/engine/autograd/staged.py": """
            def step():
                import mc2.engine.autograd.ops as ops   # closes ops -> staged -> ops
                return ops
        """,
        "mc2/observation/__init__.py": "",
        "mc2/observation/timeline.py": """
            from mc2.device import clock
            from mc2.engine.transport import comm       # observation reaching into the engine
        """,
        "mc2/tools/__init__.py": "",
        "mc2/tools/cli.py": "import mc2\nfrom mc2.engine.autograd import ops\n",
    })
    modules, edges = import_graph(src)
    pairs = {(e.source, e.target) for e in edges}
    assert ("mc2.engine.transport.comm", "mc2.device.clock") in pairs      # from ...device import
    assert ("mc2.engine.autograd", "mc2.engine.autograd.ops") in pairs     # from . import ops
    assert ("mc2.tools.cli", "mc2") in pairs

    found = {frozenset(members) for members in cycle_sets(modules, edges)}
    assert found == {
        frozenset({"mc2.engine.autograd.ops", "mc2.engine.autograd.staged"}),
        frozenset({"mc2.engine.transport.comm", "mc2.engine.decide.plan"}),
    }, found
    # a package and its submodule that name each other only one way are no cycle
    assert not any("mc2.engine.autograd" in c for c in found)

    bad = {(e.source, e.target) for e, _ in layer_violations(edges)}
    assert bad == {
        ("mc2.engine.transport.comm", "mc2.engine.decide.plan"),
        ("mc2.observation.timeline", "mc2.engine.transport.comm"),
    }, bad


def test_checker_rules_on_a_synthetic_graph() -> None:
    def edge(a: str, b: str) -> Edge:
        return Edge(a, b, "x.py", 1)

    edges = [
        edge("mc2.device.streams", "mc2.engine.transport.comm"),        # device reaching up
        edge("mc2.engine.transport.comm", "mc2.device.clock"),          # fine
        edge("mc2.engine.compute.experts", "mc2.engine.transport.wire"),  # fine
        edge("mc2.engine.compute.experts", "mc2.engine.passes.pipeline"),  # up a floor
        edge("mc2.engine.decide.planner", "mc2.parallel.mesh"),         # out of the engine
        edge("mc2.engine.passes.pipeline", "mc2"),                      # the public face
        edge("mc2.observation.profiler", "mc2.device.clock"),           # fine
        edge("mc2.observation.profiler", "mc2.engine.autograd.ops"),    # observation -> engine
        edge("mc2.tools.cli", "mc2.engine.autograd.ops"),               # tools: anything
        edge("mc2.layer", "mc2.observation.timeline"),                  # fine
        edge("mc2.a", "mc2.b"), edge("mc2.b", "mc2.c"), edge("mc2.c", "mc2.a"),  # a cycle
    ]
    bad = {(e.source, e.target) for e, _ in layer_violations(edges)}
    assert bad == {
        ("mc2.device.streams", "mc2.engine.transport.comm"),
        ("mc2.engine.compute.experts", "mc2.engine.passes.pipeline"),
        ("mc2.engine.decide.planner", "mc2.parallel.mesh"),
        ("mc2.engine.passes.pipeline", "mc2"),
        ("mc2.observation.profiler", "mc2.engine.autograd.ops"),
    }, bad
    found = cycles(["mc2.a", "mc2.b", "mc2.c"], edges)
    assert [[e.source for e in c] for c in found] == [["mc2.a", "mc2.b", "mc2.c"]]
    assert "mc2.a -> mc2.b -> mc2.c -> mc2.a" in _cycle_text(found[0])
