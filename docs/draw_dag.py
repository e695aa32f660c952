"""Draw the EvoESAP DAG from its compiled KFP spec: docs/dag.svg (the README's picture).

    python docs/draw_dag.py [--config examples/demo.yaml] [--out docs/dag.svg]

The picture shows every optional step: the configuration's quantize section and `publish_models: true`, so
every stage of the registry (`evoesap.registry.STAGES`) is a node (tests/system/test_docs_reference.py checks it).
Nodes are the stage tasks (nested sub-pipeline and loop flattened) and the pipeline's inputs (the model and the
data files), edges the artifacts they pass; the tasks of the criterion x sparsity loop are one boxed group.
The layout is graphviz's `dot` (needed to redraw, not to test: the SVG records the digest of the graph it drew,
and the test checks the committed picture against the graph the spec gives now).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import tempfile
from pathlib import Path

import networkx as nx
import yaml
from evoesap.pipeline.config import load_config
from evoesap.pipeline.dag import compile_pipeline

ROOT = Path(__file__).resolve().parents[1]
INPUT_LABELS = {
    "model": "model",
    "calibration_data": "calibration\ndata",
    "search_data": "search\ndata",
    "heldout_data": "held-out\ndata",
}
DIGEST = re.compile(r"<!-- dot source sha256: ([0-9a-f]{64}) -->")


def _graph(spec: dict) -> nx.DiGraph:
    """Leaf tasks, the pipeline's model and data inputs, and the artifacts between them, from a compiled spec."""
    graph = nx.DiGraph()
    comps = spec["components"]

    def output_of(dag: dict, task: str, key: str, path: str) -> tuple[str, str]:
        component = comps[dag[task]["componentRef"]["name"]]
        if "dag" not in component:
            return f"{path}/{task}", key
        (selector,) = component["dag"]["outputs"]["artifacts"][key]["artifactSelectors"]
        return output_of(component["dag"]["tasks"], selector["producerSubtask"], selector["outputArtifactKey"], f"{path}/{task}")

    def add_input(name: str) -> str:
        # a root parameter that names the model or a data file: a node on the left
        node = f"input:{name}"
        label = INPUT_LABELS.get(name, name.removesuffix("_data").replace("_", "-") + "\ndata")
        graph.add_node(node, label=label, kind="input", loop=False)
        return node

    def walk(dag: dict, path: str, given: dict, params: dict[str, str], loop: str | None) -> None:
        for name, task in dag.items():
            sources = {}
            for arg, ref in task.get("inputs", {}).get("artifacts", {}).items():
                if "taskOutputArtifact" in ref:
                    out = ref["taskOutputArtifact"]
                    sources[arg] = output_of(dag, out["producerTask"], out["outputArtifactKey"], path)
                elif ref.get("componentInputArtifact") in given:
                    sources[arg] = given[ref["componentInputArtifact"]]
            # the root parameters each parameter of this task comes from
            roots = {
                arg: params.get(ref["componentInputParameter"])
                for arg, ref in task.get("inputs", {}).get("parameters", {}).items()
                if "componentInputParameter" in ref
            }
            component = comps[task["componentRef"]["name"]]
            node = f"{path}/{name}"
            if "dag" in component:
                inner_loop = loop
                if "parameterIterator" in task:
                    inner_loop = node
                    items = task["parameterIterator"]["items"]["inputParameter"]
                    graph.graph.setdefault("loops", {})[node] = roots.get(items)
                walk(component["dag"]["tasks"], node, sources, {k: v for k, v in roots.items() if v}, inner_loop)
                continue
            stage = re.sub(r"^comp-|-\d+$", "", task["componentRef"]["name"])
            if stage == "model-reference":  # the importer that names the model: the model input itself
                graph.add_node(node, label="model", kind="input", loop=False)
                continue
            label = stage
            if stage == "prune":
                label += "\nsearched" if "allocation" in sources else "\nuniform"
            data = roots.get("data")
            if stage == "cache-logits" and data:  # two caches: of the search data and of the held-out data
                label += "\n" + INPUT_LABELS.get(data, data).split("\n")[0]
            graph.add_node(node, label=label, kind="task", loop=loop, sources=sources)
            if data:
                graph.add_edge(add_input(data), node)
            for producer, _ in sources.values():
                graph.add_edge(producer, node)

    top = spec["root"]
    walk(top["dag"]["tasks"], "", {}, {k: k for k in top.get("inputDefinitions", {}).get("parameters", {})}, None)
    for _, data in graph.nodes(data=True):  # an evaluation says which model it scores
        if data["label"] == "evaluate" and "model" in data["sources"]:
            producer = graph.nodes[data["sources"]["model"][0]]["label"].split("\n")
            data["label"] += "\n" + {"model": "base model", "quantize": "quantized"}.get(producer[0], producer[-1])
    graph.graph["defaults"] = {k: v.get("defaultValue") for k, v in top.get("inputDefinitions", {}).get("parameters", {}).items()}
    return graph


def stages_drawn(spec: dict) -> set[str]:
    """The stages the picture of `spec` shows (its tasks' first label lines; the check that ends a run whose gate
    failed is not a stage)."""
    graph = _graph(spec)
    return {data["label"].split("\n")[0] for _, data in graph.nodes(data=True) if data["kind"] == "task"} - {"check-verdicts"}


def compiled_spec(config_path: Path) -> dict:
    """The compiled KFP spec of the configuration at `config_path`, with every optional step on."""
    config = yaml.safe_load(config_path.read_text())
    config["publish_models"] = True
    config.setdefault("gate", {}).setdefault("min_heldout_esap", 0.9)  # the release gate before publish
    with tempfile.TemporaryDirectory() as tmp:
        return yaml.safe_load(compile_pipeline(load_config(config), Path(tmp) / "spec.yaml").read_text())


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_source(spec: dict) -> str:
    """The graph of `spec` in graphviz's language: left to right, inputs first, the loop's tasks in one box."""
    graph = _graph(spec)
    ids = {node: f"n{i}" for i, node in enumerate(sorted(graph))}
    lines = [
        "digraph evoesap {",
        '  rankdir=LR; nodesep=0.18; ranksep=0.3; newrank=true; bgcolor="white"; pad=0.1;',
        '  node [shape=box, style="rounded,filled", fontname="DejaVu Sans", fontsize=17, margin="0.07,0.04",'
        ' color="#555555", fillcolor="#f2f2f2", height=0.4];',
        '  edge [color="#777777", arrowsize=0.7, penwidth=1.1];',
    ]
    inputs = [n for n in sorted(graph) if graph.nodes[n]["kind"] == "input"]
    inputs.sort(key=lambda n: (graph.nodes[n]["label"] != "model", graph.nodes[n]["label"]))
    for node in inputs:
        lines.append(f'  {ids[node]} [label={_quote(graph.nodes[node]["label"])}, shape=box, style="filled", fillcolor="white"];')
    lines.append("  { rank=source; " + " ".join(ids[n] for n in inputs) + " }")
    for loop, items in graph.graph.get("loops", {}).items():
        grid = graph.graph["defaults"].get(items) or []
        title = "for each criterion \u00d7 sparsity" + (f" in the grid (here \u00d7{len(grid)})" if grid else "")
        lines += [
            f"  subgraph cluster_{len(lines)} {{",
            f'    label={_quote(title)}; labeljust=l; fontname="DejaVu Sans";'
            ' fontsize=17; style="rounded,filled"; color="#4a7fb5"; fillcolor="#eaf2fb"; penwidth=1.3;',
        ]
        for node in sorted(graph):
            if graph.nodes[node]["loop"] == loop:
                lines.append(f'    {ids[node]} [label={_quote(graph.nodes[node]["label"])}, fillcolor="#cfe3f5"];')
        lines.append("  }")
    for node in sorted(graph):
        data = graph.nodes[node]
        if data["kind"] == "task" and not data["loop"]:
            lines.append(f"  {ids[node]} [label={_quote(data['label'])}];")
    sinks = [ids[n] for n in sorted(graph) if graph.out_degree(n) == 0 and not graph.nodes[n]["loop"]]
    lines.append("  { rank=sink; " + " ".join(sinks) + " }")
    for u, v in sorted(nx.transitive_reduction(graph).edges):
        lines.append(f"  {ids[u]} -> {ids[v]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def drawn_digest(svg: str) -> str | None:
    """The digest of the graph an SVG drawn by `draw` shows."""
    found = DIGEST.search(svg)
    return found.group(1) if found else None


def draw(spec: dict, out: Path) -> Path:
    source = dot_source(spec)
    svg = subprocess.run(["dot", "-Tsvg"], input=source, capture_output=True, text=True, check=True).stdout
    svg = re.sub(r"<!-- Generated by graphviz[^>]*-->\n", "", svg)  # no version churn in the committed file
    # sizes in px, not pt: one unit of the drawing is one pixel at its natural size, fonts included
    svg = re.sub(r'(<svg width="[\d.]+)pt" height="([\d.]+)pt"', r'\1" height="\2"', svg, count=1)
    svg = svg.replace("<svg ", f"<!-- dot source sha256: {digest(source)} -->\n<svg ", 1)
    out.write_text(svg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "demo.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dag.svg")
    parser.add_argument("--dot", action="store_true", help="print the graph in graphviz's language, draw nothing")
    args = parser.parse_args()
    spec = compiled_spec(args.config)
    print(dot_source(spec) if args.dot else draw(spec, args.out))


if __name__ == "__main__":
    main()
