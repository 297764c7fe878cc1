"""The package's layers, enforced: every import (top level and inside functions) goes down the order written
in docs/architecture.md, no module imports itself back through others, and no private name crosses modules.

A failure names the importing file and line and the module it imports, e.g.
    openk3/model/moe.py:7 imports openk3.train.trainer: layer 'train' (10) is above 'model' (6); a layer may
    only import layers below it
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import openk3

PACKAGE = Path(openk3.__file__).parent

#: Bottom to top. A module may import its own package (subpackage) and any layer below its own; packages of one
#: layer are siblings and do not import each other. "openk3" is the package root (`openk3/__init__.py`, the
#: public API: `load`, `save`, `LLM`, ...). Keep docs/architecture.md's diagram in step with this list.
LAYERS: list[tuple[str, ...]] = [
    ("fsutil", "config_rules", "config_types", "log", "stats"),  # stdlib only
    ("config", "chart", "tokenizer", "chat"),  # no torch: configs, plots, tokenizer, the XTML chat format
    ("plan", "peers"),  # torch-free arithmetic over configs (counts, memory, cost); transformers' peer (lazy)
    ("common",),  # torch helpers
    ("ops",),  # pure tensor functions
    ("quant",),  # weight formats (MXFP4, integer trunks)
    ("model",),  # single-device nn.Modules
    ("stream",),  # routed experts read from a checkpoint's shards into a per-layer cache (openk3.load's)
    ("checkpoint", "data"),  # release-format folders and run checkpoints; corpora, token shards, loaders
    ("parallel",),  # FSDP2 / EP / PP / activation checkpointing, applied from outside the model
    ("train",),  # the run loop and pretraining
    ("infer", "agent", "hf"),  # engine and LLM; sandboxes, tools, task families; transformers/PEFT adapter
    ("serve",),  # the OpenAI-compatible server
    ("posttrain", "scaling"),  # SFT, RL, MOPD, merging, evaluation; the scaling lab's families, ladders, fits
    ("experiments",),  # each claim as an experiment with a control and intervals
    ("commands", "openk3"),  # the CLI's commands; the public API
    ("__main__",),  # `python -m openk3` / the `openk3` door
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
#: Inside a package with rooms, the same rule one level down (the rooms are listed in the package docstring).
ROOMS: dict[str, list[tuple[str, ...]]] = {
    "posttrain": [("domains",), ("trainers",), ("evaluation", "merge"), ("pipeline",)],
    "experiments": [("tasks", "full"), ("result", "arms"), ("rl_heldout", "mopd_vs_merge", "effort_budget", "scaling")],
}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def from_module(node: ast.ImportFrom, path: Path, name: str) -> str:
    """The absolute module a `from ... import` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
    return ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, int, str | None]]:
    """(imported module, line, imported name or None) for every openk3 import in `path`, at any depth. `from
    pkg import sub` counts as importing the module `pkg.sub` when there is one, else `pkg` (one of its names);
    `importlib.import_module("openk3....")` with a literal name counts too."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
                and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                and node.args[0].value.startswith("openk3.")):
            found.append((node.args[0].value, node.lineno, None))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno, None) for a in node.names if a.name.split(".")[0] == "openk3"]
        elif isinstance(node, ast.ImportFrom):
            source = from_module(node, path, name)
            if source.split(".")[0] != "openk3":
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                found.append((sub, node.lineno, None) if sub in known else (source, node.lineno, a.name))
    out = []
    for target, line, what in found:
        while target not in known and "." in target:  # `import openk3.x.y` of a name: its module
            target = target.rpartition(".")[0]
        if target in known and target != name:
            out.append((target, line, what))
    return out


def file_of(files: dict[str, Path], module: str) -> Path:
    """The module's file as the messages name it: relative to the folder holding the package."""
    return files[module].relative_to(files["openk3"].parent.parent)


def import_graph(root: Path = PACKAGE) -> dict[str, list[tuple[str, int, str | None]]]:
    files = module_files(root)
    return {name: imports(path, name, set(files)) for name, path in files.items()}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] in ROOMS else None


def back_edges(graph, files: dict[str, Path]) -> list[str]:
    """Imports that go up the layer order or sideways to a sibling package (or room)."""
    bad = []
    for src, targets in graph.items():
        a = layer_of(src)
        for dst, line, _ in targets:
            b = layer_of(dst)
            if a == b:
                ra, rb = room_of(src), room_of(dst)
                if ra is None or rb is None or ra == rb:
                    continue
                rank = {name: i for i, room in enumerate(ROOMS[a]) for name in room}
                assert ra in rank and rb in rank, f"{src} -> {dst}: add {ra!r} / {rb!r} to ROOMS[{a!r}]"
                if rank[rb] >= rank[ra]:
                    where = "above" if rank[rb] > rank[ra] else "beside"
                    bad.append(f"{file_of(files, src)}:{line} imports {dst}: room {a}/{rb} is "
                               f"{where} {a}/{ra}; a room may only import rooms below it")
                continue
            assert a in RANK and b in RANK, f"{src} -> {dst}: add {a!r} / {b!r} to LAYERS (and the diagram)"
            if RANK[b] >= RANK[a]:
                where = "above" if RANK[b] > RANK[a] else "beside"
                bad.append(f"{file_of(files, src)}:{line} imports {dst}: layer {b!r} "
                           f"({RANK[b]}) is {where} {a!r} ({RANK[a]}); a layer may only import layers below it")
    return bad


def cycles(graph, files: dict[str, Path]) -> list[str]:
    """Every circle of imports between modules (Tarjan's strongly connected components), with the lines."""
    succ = {m: sorted({t for t, _, _ in ts}) for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:  # iterative: the graph is a few hundred modules, recursion would do too
        work = [(v, iter(succ[v]))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(succ[nxt])))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))

    for m in succ:
        if m not in index:
            visit(m)
    out = []
    for comp in comps:
        members = set(comp)
        lines = sorted({f"{file_of(files, s)}:{line} imports {t}" for s in comp
                        for t, line, _ in graph[s] if t in members})
        out.append("import cycle between " + ", ".join(comp) + ":\n    " + "\n    ".join(lines))
    return out


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` of a chain of names, None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (head := dotted(node.value)) is not None:
        return f"{head}.{node.attr}"
    return None


def private_imports(graph, files: dict[str, Path]) -> list[str]:
    """`from openk3.x import _name` across modules, and `module._name` on an imported openk3 module."""
    bad = []
    for src, targets in graph.items():
        for dst, line, what in targets:
            if what is not None and what.startswith("_") and not what.startswith("__"):
                bad.append(f"{file_of(files, src)}:{line} imports the private {dst}.{what}")
        tree = ast.parse(files[src].read_text())
        aliases = {}  # local name -> openk3 module bound to it
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("openk3.") and a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                source = from_module(node, files[src], src)
                for a in node.names:
                    if any(t == f"{source}.{a.name}" for t, _, _ in targets):
                        aliases[a.asname or a.name] = f"{source}.{a.name}"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            owner = dotted(node.value)  # `alias._x`, or the full path `openk3.x.y._x`
            owner = aliases.get(owner, owner) if owner else None
            if owner is not None and owner in files and owner != src:
                bad.append(f"{file_of(files, src)}:{node.lineno} uses the private "
                           f"{owner}.{node.attr}")
    return bad


@functools.cache
def package_graph() -> dict[str, list[tuple[str, int, str | None]]]:
    """The package's import graph, parsed once per test process (callers copy before changing it)."""
    return import_graph()


def test_every_package_has_a_layer():
    files = module_files()
    assert not sorted({layer_of(m) for m in files} - set(RANK))


def test_imports_go_down_the_layers():
    files = module_files()
    assert back_edges(package_graph(), files) == []


def test_no_import_cycles():
    files = module_files()
    assert cycles(package_graph(), files) == []


def test_no_private_name_crosses_modules():
    files = module_files()
    assert private_imports(package_graph(), files) == []


def test_an_injected_back_edge_and_cycle_are_caught():
    """The checks can fail: model importing the trainer (a back-edge, and a cycle, since the trainer imports the
    model) is reported with the file and line of the import."""
    files = module_files()
    graph = {m: list(ts) for m, ts in package_graph().items()}
    graph["openk3.model.moe"].append(("openk3.train.trainer", 7, None))
    edges = back_edges(graph, files)
    assert edges == ["openk3/model/moe.py:7 imports openk3.train.trainer: layer 'train' (10) is above 'model' (6); "
                     "a layer may only import layers below it"]
    found = cycles(graph, files)
    assert len(found) == 1 and "openk3.model.moe" in found[0] and "openk3.train.trainer" in found[0]
    assert "openk3/model/moe.py:7 imports openk3.train.trainer" in found[0]
    graph["openk3.infer.llm"].append(("openk3.agent.env", 3, None))  # siblings do not import each other
    assert any(e.startswith("openk3/infer/llm.py:3 imports openk3.agent.env: layer 'agent' (11) is beside 'infer'")
               for e in back_edges(graph, files))
    graph["openk3.posttrain.domains.general"].append(("openk3.posttrain.trainers.rl", 9, None))
    assert any(e.startswith("openk3/posttrain/domains/general.py:9 imports openk3.posttrain.trainers.rl: room "
                            "posttrain/trainers is above posttrain/domains") for e in back_edges(graph, files))
    graph["openk3.serve.app"].append(("openk3.model.model", 5, "_query"))
    assert private_imports(graph, files)[0] == "openk3/serve/app.py:5 imports the private openk3.model.model._query"


def test_import_parser_sees_dynamic_imports_and_private_attribute_paths(tmp_path):
    pkg = tmp_path / "openk3"
    (pkg / "agent").mkdir(parents=True)
    for f in ("__init__.py", "agent/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "agent" / "reg.py").write_text("import importlib\n\n\ndef load():\n"
                                          "    importlib.import_module('openk3.agent.fam')\n")
    (pkg / "agent" / "fam.py").write_text("import openk3.agent.reg\n\nX = openk3.agent.reg._hidden\n")
    graph = import_graph(pkg)
    assert graph["openk3.agent.reg"] == [("openk3.agent.fam", 5, None)]
    assert graph["openk3.agent.fam"] == [("openk3.agent.reg", 1, None)]
    files = module_files(pkg)
    assert len(cycles(graph, files)) == 1
    assert private_imports(graph, files) == ["openk3/agent/fam.py:3 uses the private openk3.agent.reg._hidden"]


def test_import_parser_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "openk3"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("from .a import f\n")
    (pkg / "model" / "a.py").write_text("def f():\n    from openk3.train import loop\n    return loop\n")
    (pkg / "train").mkdir()
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "loop.py").write_text("from ..model.a import f as _g\n")
    graph = import_graph(pkg)
    assert graph["openk3.model"] == [("openk3.model.a", 1, "f")]
    assert graph["openk3.model.a"] == [("openk3.train.loop", 2, None)]
    assert graph["openk3.train.loop"] == [("openk3.model.a", 1, "f")]
