"""The package graph of evoesap drawn from its imports (docs/packages.svg), and the check that its arrows run one way.

    python docs/package_graph.py [--out docs/packages.svg]    # draw, then check (exit 1 on a problem)
    python docs/package_graph.py --check                      # check only

A node is a sub-package of evoesap (`store`, `method`, `machine`, ...) or a module at its top (`params`,
`registry`, ...); components/ and pipeline/, which install as `evoesap.components` and `evoesap.pipeline`, are
one node, `kfp`. An edge A -> B: a module of A imports a module of B, at the top of the file or inside a
function (a lazy import is still a dependency). The check: no module imports itself back through others, and
the graph of nodes has no cycle, so the arrows between sub-packages run one way. The registry names stage code
as "module:function" strings, which are not imports: that is what keeps it at the bottom. Only the standard
library is needed for the check; drawing uses matplotlib and networkx (both dependencies of the package).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KFP = "kfp"
FOLDERS = (("evoesap", "evoesap"), ("components", "evoesap.components"), ("pipeline", "evoesap.pipeline"))


def module_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Every module of the package (components/ and pipeline/ under their installed names) -> the package's
    modules it imports."""
    modules = {}
    for folder, package in FOLDERS:
        for path in (root / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(root / folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path

    def known(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {known(a.name) for a in node.names if a.name.startswith("evoesap")}
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                module = (base + ("." + node.module if node.module else "")) if node.level else node.module or ""
                if module.startswith("evoesap"):
                    found |= {known(f"{module}.{a.name}") for a in node.names}
        graph[name] = found - {name, ""}
    return graph


def node_of(module: str) -> str:
    """The node a module belongs to: `evoesap.store.artifacts` -> `store`, `evoesap.params` -> `params`."""
    parts = module.split(".")
    if parts[:2] in (["evoesap", "components"], ["evoesap", "pipeline"]):
        return KFP
    return parts[1] if len(parts) > 1 else "evoesap"


def node_graph(modules: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto nodes, without self-loops (the package's own `__init__` is left out: it
    imports nothing)."""
    graph: dict[str, set[str]] = {}
    for module, imported in modules.items():
        if module == "evoesap":
            continue
        graph.setdefault(node_of(module), set()).update(node_of(m) for m in imported if m != "evoesap")
    return {node: targets - {node} for node, targets in graph.items()}


def _cycle(graph: Mapping[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, or None."""
    todo, came = [start], {}
    while todo:
        node = todo.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if nxt not in came:
                came[nxt] = node
                todo.append(nxt)
    return None


def problems(modules: Mapping[str, set[str]]) -> list[str]:
    """One line per cycle: between modules (a package's `__init__` importing its own submodules is not one),
    then between nodes."""
    found = []
    for module in sorted(modules):
        own = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in modules.items()}
        loop = _cycle(own, module)
        if loop:
            found.append("module cycle: " + " -> ".join(loop))
    nodes = node_graph(modules)
    for node in sorted(nodes):
        loop = _cycle(nodes, node)
        if loop:
            found.append("package cycle: " + " -> ".join(loop))
    return found


def layers(nodes: Mapping[str, set[str]]) -> dict[str, int]:
    """Each node's layer: 0 for a node importing nothing, else one more than the highest node it imports."""
    layer: dict[str, int] = {}

    def of(node: str) -> int:
        if node not in layer:
            layer[node] = 1 + max((of(d) for d in nodes.get(node, ())), default=-1)
        return layer[node]

    for node in nodes:
        of(node)
    return layer


def draw(nodes: Mapping[str, set[str]], out: Path) -> None:
    """Nodes in rows by layer (the bottom row imports nothing); each arrow points from importer to imported.
    Arrows implied by two others (A -> B -> C makes A -> C) are left out, so the picture stays readable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    graph = nx.DiGraph([(a, b) for a, targets in nodes.items() for b in targets])
    graph.add_nodes_from(nodes)
    reduced = nx.transitive_reduction(graph)
    layer = layers(nodes)
    rows: dict[int, list[str]] = {}
    for node in sorted(nodes, key=lambda n: (layer[n], n)):
        rows.setdefault(layer[node], []).append(node)
    width = max(len(row) for row in rows.values())
    pos: dict[str, tuple[float, int]] = {}
    for level in sorted(rows, reverse=True):  # top row first; each row ordered under its importers (fewer crossings)
        above = {n: [pos[a][0] for a in graph.predecessors(n) if a in pos] for n in rows[level]}
        row = sorted(rows[level], key=lambda n: (sum(above[n]) / len(above[n]) if above[n] else width / 2, n))
        pos.update({node: ((i + 0.5) * width / len(row), level) for i, node in enumerate(row)})
    fig, ax = plt.subplots(figsize=(1.6 * width + 1, 1.1 * len(rows) + 1))
    packages = {p.name for p in (ROOT / "evoesap").iterdir() if (p / "__init__.py").is_file()} | {KFP}
    nx.draw_networkx_edges(
        reduced, pos, ax=ax, arrowstyle="-|>", arrowsize=10, edge_color="#888888", node_size=1800, connectionstyle="arc3,rad=0.08"
    )
    for node, (x, y) in pos.items():
        boxed = node in packages
        ax.text(
            x, y, node + ("/" if boxed and node != KFP else ""), ha="center", va="center", fontsize=9,
            bbox={"boxstyle": "round,pad=0.35", "fc": "#dce9f7" if boxed else "#f4f4f4", "ec": "#4a6a8a" if boxed else "#aaaaaa"},
        )  # fmt: skip
    ax.set_axis_off()
    ax.margins(0.06, 0.08)
    fig.tight_layout()
    plt.rcParams["svg.hashsalt"] = "evoesap"
    plt.rcParams["svg.fonttype"] = "none"  # labels stay text: searchable, and the test reads them
    fig.savefig(out, format=out.suffix[1:], metadata={"Date": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "packages.svg")
    parser.add_argument("--check", action="store_true", help="check only, draw nothing")
    args = parser.parse_args(argv)
    modules = module_imports()
    if not args.check:
        draw(node_graph(modules), args.out)
        print(f"wrote {args.out}")
    found = problems(modules)
    for line in found:
        print(line, file=sys.stderr)
    print(f"{len(modules)} modules, {len(node_graph(modules))} nodes, {len(found)} cycles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
