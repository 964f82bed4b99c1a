"""The package's imports point one way: a walk over every `import` in engine/ and app/ (module level and inside
functions alike, since a lazy import is still an arrow) finds no circle. A new circle fails here with the modules
that form it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"engine": "moechat.engine", "app": "moechat.app"}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _targets(mod: str, path: Path, node: ast.AST, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = mod.split(".")
            keep = len(base) - node.level + (1 if path.name == "__init__.py" else 0)
            target = ".".join(base[:keep] + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
    out = []
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != mod:
            out.append(name)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:`: imports for annotations only, never executed, so not an arrow."""
    return isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        deps = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block) for b in block.body
                       for n in ast.walk(b)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only:
                deps.update(_targets(mod, path, node, mods))
        graph[mod] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_walk_sees_the_arrows():
    graph = import_graph()
    assert "moechat.engine.quant.base" in graph["moechat.engine.quant.intq"]
    assert "moechat.engine.cache.store" in graph["moechat.engine.load.loader"]  # a lazy import counts too
    assert "moechat.engine.models.base" not in graph["moechat.engine.cache.store"]  # under TYPE_CHECKING
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_app_imports_the_engine_never_the_reverse():
    graph = import_graph()
    back = sorted((m, d) for m, deps in graph.items() if m.startswith("moechat.engine") for d in deps
                  if d.startswith("moechat.app"))
    assert back == []


# The engine's rooms, top to bottom: a module may import its own room and the rooms below it, never one above or
# beside it (runtime and planning sit side by side: neither imports the other). docs/architecture.md draws it.
ENGINE_ROOMS = [
    ("runtime", "plan"),
    ("load",),
    ("models",),
    ("cache",),
    ("layers",),
    ("quant",),
    ("text",),
    ("io",),
    ("errors", "paths", "units", ""),
]


def _room(mod: str) -> str:
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 else ""


def up_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    rank = {room: i for i, rooms in enumerate(ENGINE_ROOMS) for room in rooms}
    return sorted((m, d) for m, deps in graph.items() if m.startswith("moechat.engine") for d in deps
                  if d.startswith("moechat.engine") and _room(m) != _room(d) and rank[_room(d)] <= rank[_room(m)])


def test_the_engine_rooms_point_down():
    graph = import_graph()
    found = {_room(m) for m in graph if m.startswith("moechat.engine")}
    assert found <= {room for rooms in ENGINE_ROOMS for room in rooms}, f"a room not in ENGINE_ROOMS: {found}"
    assert up_arrows(graph) == [], "imports that point up or sideways between rooms"


def test_the_room_check_sees_a_wrong_arrow():
    fake = {"moechat.engine.cache.store": {"moechat.engine.models.base", "moechat.engine.quant.base"},
            "moechat.engine.runtime.generate": {"moechat.engine.plan.hardware", "moechat.engine.runtime.sampling"}}
    assert up_arrows(fake) == [("moechat.engine.cache.store", "moechat.engine.models.base"),
                               ("moechat.engine.runtime.generate", "moechat.engine.plan.hardware")]
