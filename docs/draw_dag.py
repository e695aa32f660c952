"""Draw the EvoESAP DAG from its compiled KFP spec: docs/dag.svg (the README's picture).

    python docs/draw_dag.py [--config examples/demo.yaml] [--out docs/dag.svg]

The picture shows every optional step: the configuration's quantize section and `publish_models: true`, so
every stage of the registry (`evoesap.registry.STAGES`) is a node (tests/system/test_docs_reference.py checks it).
Nodes are the stage tasks (nested sub-pipeline and loop flattened) with their output artifacts and
classes, edges the artifacts they pass; tasks inside the criterion x sparsity loop are shaded.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import networkx as nx  # noqa: E402
import yaml  # noqa: E402
from evoesap.pipeline.config import load_config  # noqa: E402
from evoesap.pipeline.dag import compile_pipeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _graph(spec: dict) -> nx.DiGraph:
    """Leaf tasks and the artifacts between them, from a compiled spec."""
    graph = nx.DiGraph()
    comps = spec["components"]

    def output_of(dag: dict, task: str, key: str, path: str) -> tuple[str, str]:
        component = comps[dag[task]["componentRef"]["name"]]
        if "dag" not in component:
            return f"{path}/{task}", key
        (selector,) = component["dag"]["outputs"]["artifacts"][key]["artifactSelectors"]
        return output_of(component["dag"]["tasks"], selector["producerSubtask"], selector["outputArtifactKey"], f"{path}/{task}")

    def walk(dag: dict, path: str, given: dict[str, tuple[str, str]], in_loop: bool) -> None:
        for name, task in dag.items():
            sources = {}
            for arg, ref in task.get("inputs", {}).get("artifacts", {}).items():
                if "taskOutputArtifact" in ref:
                    out = ref["taskOutputArtifact"]
                    sources[arg] = output_of(dag, out["producerTask"], out["outputArtifactKey"], path)
                elif ref.get("componentInputArtifact") in given:
                    sources[arg] = given[ref["componentInputArtifact"]]
            component = comps[task["componentRef"]["name"]]
            if "dag" in component:
                walk(component["dag"]["tasks"], f"{path}/{name}", sources, in_loop or "parameterIterator" in task)
                continue
            node = f"{path}/{name}"
            stage = re.sub(r"^comp-|-\d+$", "", task["componentRef"]["name"])
            label = {"importer": "importer"}.get(stage, stage)
            if stage == "prune":
                label += "\nsearched" if "allocation" in sources else "\nuniform"
            outputs = component.get("outputDefinitions", {}).get("artifacts", {})
            label += "".join(f"\n{k}: {v['artifactType']['schemaTitle'].removeprefix('system.')}" for k, v in outputs.items())
            graph.add_node(node, label=label, loop=in_loop)
            for producer, _ in sources.values():
                graph.add_edge(producer, node)

    walk(spec["root"]["dag"]["tasks"], "", {}, False)
    return graph


def stages_drawn(spec: dict) -> set[str]:
    """The stages the picture of `spec` shows (its tasks' first label lines; the model reference and the check that
    ends a run whose gate failed are not stages)."""
    graph = _graph(spec)
    return {graph.nodes[node]["label"].split("\n")[0] for node in graph} - {"model-reference", "check-verdicts"}


def compiled_spec(config_path: Path) -> dict:
    """The compiled KFP spec of the configuration at `config_path`, with every optional step on."""
    config = yaml.safe_load(config_path.read_text())
    config["publish_models"] = True
    config.setdefault("gate", {}).setdefault("min_heldout_esap", 0.9)  # the release gate before publish
    with tempfile.TemporaryDirectory() as tmp:
        return yaml.safe_load(compile_pipeline(load_config(config), Path(tmp) / "spec.yaml").read_text())


def draw(spec: dict, out: Path) -> Path:
    graph = _graph(spec)
    for layer, nodes in enumerate(nx.topological_generations(graph)):
        for node in nodes:
            graph.nodes[node]["layer"] = layer
    pos = nx.multipartite_layout(graph, subset_key="layer", align="vertical", scale=1.0)
    fig, ax = plt.subplots(figsize=(16, 7))
    colours = ["#cfe3f5" if graph.nodes[n]["loop"] else "#f2f2f2" for n in graph]
    nx.draw_networkx_edges(graph, pos, ax=ax, arrows=True, arrowsize=12, node_size=5200, edge_color="#777777")
    nx.draw_networkx_nodes(graph, pos, ax=ax, node_color=colours, node_shape="s", node_size=5200, edgecolors="#444444")
    nx.draw_networkx_labels(graph, pos, labels=nx.get_node_attributes(graph, "label"), font_size=7.5, ax=ax)
    ax.set_title(
        "EvoESAP on Kubeflow: blue tasks run once per criterion x sparsity (ParallelFor); arrows are typed artifacts", fontsize=10
    )
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, format=out.suffix.lstrip("."), metadata={"Date": None} if out.suffix == ".svg" else None)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "demo.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dag.svg")
    args = parser.parse_args()
    print(draw(compiled_spec(args.config), args.out))


if __name__ == "__main__":
    main()
