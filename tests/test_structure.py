"""The shape of the code: no import cycle and no private name used across modules
in ``autoshard/``, ``passes/`` and ``policies/``, read from the source with ``ast``.

Every import counts, the ones inside functions too (a function-level import that
dodges a cycle is still a back edge). An import of an ancestor package from inside
it (``from . import x`` in ``autoshard.policies.one_d``) is not an edge: the package
is already being imported.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"autoshard": ROOT / "autoshard", "autoshard.passes": ROOT / "passes",
            "autoshard.policies": ROOT / "policies"}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted(folder.rglob("*.py")):
            parts = [pkg, *f.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            if pkg == "autoshard" and len(parts) > 1 and parts[1] in ("passes", "policies"):
                continue
            mods[".".join(parts)] = f
    return mods


MODS = _modules()


def _source_of(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod if MODS[mod].stem == "__init__" else mod.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{node.module}" if node.module else base


def _owner(name: str) -> str | None:
    """The project module ``name`` lives in (``autoshard.x.y`` → ``autoshard.x``), if any."""
    while name and name not in MODS and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODS else None


def import_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODS}
    for m, f in MODS.items():
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                src = _source_of(m, node)
                targets = [src] + [f"{src}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                o = _owner(t)
                if o and o != m and not m.startswith(o + "."):
                    edges[m].add(o)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def private_uses() -> list[str]:
    """``from x import _name`` and ``alias._name`` where ``x`` / ``alias`` is another project module."""
    bad = []
    for m, f in MODS.items():
        tree = ast.parse(f.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = _source_of(m, node)
                for a in node.names:
                    full = f"{src}.{a.name}"
                    if full in MODS:
                        aliases[a.asname or a.name] = full
                    elif src in MODS and src != m and a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"{m}: from {src} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODS and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                owner = aliases[node.value.id]
                if owner != m and node.attr.startswith("_") and not node.attr.startswith("__"):
                    bad.append(f"{m}: {node.value.id}.{node.attr} ({owner})")
    return sorted(set(bad))


def test_the_scan_sees_every_module():
    assert {"autoshard.api", "autoshard.passes.propagate", "autoshard.policies.one_d"} <= set(MODS)
    edges = import_graph()
    assert "autoshard.policies.base" in edges["autoshard.passes.propagate"]
    assert "autoshard.ir.kernels" in edges["autoshard.policies.one_d"]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" ↔ ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_across_modules():
    found = private_uses()
    assert not found, "private names used across modules:\n" + "\n".join(found)


@pytest.mark.parametrize("layer,forbidden", [
    ("autoshard.policies", ("autoshard.passes", "autoshard.runtime.parallel_ops", "autoshard.runtime.collectives", "autoshard.api")),
    ("autoshard.passes", ("autoshard.api", "autoshard.cli", "autoshard.planning.search")),
])
def test_layers_import_downwards(layer, forbidden):
    """Policies import no pass and no runtime; passes never import the face (docs/design.md, "Layers")."""
    edges = import_graph()
    bad = sorted(f"{m} → {t}" for m, ts in edges.items() if m == layer or m.startswith(layer + ".")
                 for t in ts if any(t == f or t.startswith(f + ".") for f in forbidden))
    assert not bad, bad


# The layers of the package, bottom to top (docs/design.md, "Layers"): a module may
# import its own layer and the layers below it, never one above.
# The launch pipeline (the config it reads, the stages, the recapture that runs them) sits
# above planning: its prepare and plan stages call the search and the checks.
LAYERS = ("autoshard.ir", "autoshard.policies", "autoshard.runtime", "autoshard.passes", "autoshard.io",
          "autoshard.launch", "autoshard.planning", "autoshard.config", "autoshard.launch.pipeline",
          "autoshard.launch.recapture", "autoshard", "autoshard.training")


def layer_of(mod: str) -> int:
    """The index in :data:`LAYERS` of the layer ``mod`` belongs to (the top-level
    modules of ``autoshard``, the face, are ``autoshard`` itself)."""
    best = max((l for l in LAYERS if mod == l or mod.startswith(l + ".")), key=len)
    return LAYERS.index(best)


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} → {t}" for m, ts in edges.items() for t in ts if layer_of(t) > layer_of(m))


def test_every_module_has_a_layer():
    assert layer_of("autoshard.ir.spec") == 0 and layer_of("autoshard.api") == LAYERS.index("autoshard")
    assert layer_of("autoshard.training.zero") == len(LAYERS) - 1


def test_imports_run_down_the_layers():
    found = layer_violations(import_graph())
    assert not found, "imports up the layers:\n" + "\n".join(found)


def test_the_layer_check_finds_an_upward_import():
    assert layer_violations({"autoshard.ir.kernels": {"autoshard.runtime.parallel_ops"},
                             "autoshard.runtime.groups": {"autoshard.ir.mesh"}}) \
        == ["autoshard.ir.kernels → autoshard.runtime.parallel_ops"]


def undocumented(source: str, where: str = "") -> list[str]:
    """``where:line name`` of every public function, class and method of ``source`` (a
    module's text) with no docstring; nested functions are the enclosing one's business."""
    found = []

    def walk(body, prefix):
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not n.name.startswith("_"):
                if ast.get_docstring(n) is None:
                    found.append(f"{where}:{n.lineno} {prefix}{n.name}")
                if isinstance(n, ast.ClassDef):
                    walk(n.body, f"{prefix}{n.name}.")

    walk(ast.parse(source).body, "")
    return found


def test_every_public_policy_name_has_a_docstring():
    """Every public function, class and method in ``policies/`` has a docstring;
    the scan itself is shown to catch a method that lost its docstring."""
    found = [hit for f in sorted((ROOT / "policies").rglob("*.py")) for hit in undocumented(f.read_text(), f.name)]
    assert not found, "public names in policies/ without a docstring:\n" + "\n".join(found)
    probe = 'class P:\n    """A mode."""\n\n    def linear(self):\n        return 1\n\n    def _helper(self):\n        pass\n'
    assert undocumented(probe, "p.py") == ["p.py:4 P.linear"]


def _own_private_fields(tree: ast.AST) -> set[str]:
    """The ``_fields`` a module's classes assign on ``self``."""
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
            and n.attr.startswith("_") and not n.attr.startswith("__") and isinstance(n.ctx, ast.Store)}


def private_field_reaches(sources: dict[str, str]) -> list[str]:
    """``obj._field`` (``obj`` not ``self`` / ``cls``) where ``_field`` is a private field
    that another module's class assigns on ``self`` and this module does not: one module
    reaching into another's object state (``module._generator`` read from generate.py)."""
    trees = {m: ast.parse(src) for m, src in sources.items()}
    own = {m: _own_private_fields(t) for m, t in trees.items()}
    bad = []
    for m, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__") \
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")) and n.attr not in own[m]:
                owners = sorted(o for o, fields in own.items() if o != m and n.attr in fields)
                if owners:
                    bad.append(f"{m}:{n.lineno}: .{n.attr} (a field of {', '.join(owners)})")
    return sorted(bad)


def test_no_module_reaches_into_another_modules_private_fields():
    found = private_field_reaches({m: f.read_text() for m, f in MODS.items()})
    assert not found, "private fields reached from another module:\n" + "\n".join(found)


def test_the_field_scan_finds_a_reach():
    owner = "class M:\n    def __init__(self):\n        self._generator = None\n"
    user = "def f(module):\n    return module._generator\n"
    assert private_field_reaches({"a": owner, "b": user}) == ["b:2: ._generator (a field of a)"]


def unresolved_relative_imports() -> list[str]:
    """``m: from ..x import y`` where ``..x`` names no module of the project: a relative
    import left pointing at the old place after a move (a function-level one fails only
    when that function runs)."""
    bad = []
    for m, f in MODS.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                src = _source_of(m, node)
                if src not in MODS and not all(f"{src}.{a.name}" in MODS for a in node.names):
                    bad.append(f"{m}:{node.lineno}: from {'.' * node.level}{node.module or ''} ({src})")
    return sorted(bad)


def test_every_relative_import_names_a_module():
    found = unresolved_relative_imports()
    assert not found, "relative imports of no module:\n" + "\n".join(found)


# ------------------------------------------------------------------ the launch pipeline (docs/design.md, "Launch pipeline")

# what the launch pipeline's stages wrap: a module outside passes/ that calls one of them wires
# the pipeline by hand
PIPELINE_PASSES = {"autoshard.passes.capture": {"capture"},
                   "autoshard.passes.pipeline": {"prepare", "plan_captured", "plan_prepared"},
                   "autoshard.passes.rewrite": {"rewrite"},
                   "autoshard.launch.capture_share": {"capture_shared", "capture_cached", "capture_for_plan"}}
# the two modules that may: the pipeline, and the search (it plans each candidate it prices)
PIPELINE_CALLERS = {"autoshard.launch.pipeline", "autoshard.planning.search"}
# the shared capture itself: capture_shared / capture_cached run the export they share
CAPTURE_ITSELF = {"autoshard.launch.capture_share"}


def pipeline_pass_callers() -> dict[str, list[str]]:
    """Module -> the pipeline passes it calls by name, for every module outside ``passes/``
    (function-level imports too; an alias follows its name)."""
    out = {}
    for m, f in MODS.items():
        if m.startswith("autoshard.passes") or m.startswith("autoshard.policies") or m in CAPTURE_ITSELF:
            continue
        tree = ast.parse(f.read_text())
        names: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = _source_of(m, node)
                for a in node.names:
                    if a.name in PIPELINE_PASSES.get(src, ()):
                        names[a.asname or a.name] = a.name
        called = sorted({names[n.func.id] for n in ast.walk(tree)
                         if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names})
        if called:
            out[m] = called
    return out


def test_only_the_pipeline_and_the_search_call_the_pipeline_passes():
    callers = pipeline_pass_callers()
    assert "autoshard.launch.pipeline" in callers          # the scan sees the calls
    extra = {m: c for m, c in callers.items() if m not in PIPELINE_CALLERS}
    assert not extra, f"modules wiring capture/prepare/plan/rewrite by hand (run autoshard.launch.pipeline): {extra}"


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 800, 80
# over the limits, with why (empty: every module and function fits)
KNOWN_LONG: set[str] = set()


def too_long() -> list[str]:
    """Modules over :data:`MAX_MODULE_LINES` lines and functions over :data:`MAX_FUNCTION_LINES`
    (decorators left out, docstring in) in ``autoshard/``, ``passes/`` and ``policies/``."""
    out = []
    for f in sorted(set(MODS.values())):
        rel = f.relative_to(ROOT).as_posix()
        src = f.read_text()
        if src.count("\n") > MAX_MODULE_LINES:
            out.append(rel)
        out += [f"{rel}:{n.name}" for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    return out


def test_no_module_or_function_too_long():
    found = [x for x in too_long() if x not in KNOWN_LONG]
    assert not found, f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: {found}"
