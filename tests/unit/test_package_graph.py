"""The package graph (docs/package_graph.py, drawn in docs/ARCHITECTURE.md): arrows between evoesap's
sub-packages run one way, and the check itself finds a cycle when there is one."""

from pathlib import Path

from scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _script():
    return load_script("docs/package_graph.py")


def test_the_package_graph_has_no_cycle():
    graph = _script()
    assert graph.problems(graph.module_imports()) == []


def test_a_two_way_import_between_packages_is_found():
    graph = _script()
    modules = {
        "evoesap.store.artifacts": {"evoesap.errors"},
        "evoesap.errors": set(),
        "evoesap.method.search": {"evoesap.store.artifacts"},
        "evoesap.store.lineage": {"evoesap.method.racing"},  # store -> method, while method -> store
        "evoesap.method.racing": set(),
    }
    assert graph.problems(modules) == ["package cycle: method -> store -> method", "package cycle: store -> method -> store"]
    modules["evoesap.store.lineage"] = set()
    assert graph.problems(modules) == []
    assert graph.layers(graph.node_graph(modules)) == {"errors": 0, "store": 1, "method": 2}


def test_a_module_cycle_is_found_even_inside_one_package():
    graph = _script()
    modules = {
        "evoesap.store.a": {"evoesap.store.b"},
        "evoesap.store.b": {"evoesap.store.a"},
        "evoesap.store": {"evoesap.store.a"},
    }
    assert graph.problems(modules) == [
        "module cycle: evoesap.store.a -> evoesap.store.b -> evoesap.store.a",
        "module cycle: evoesap.store.b -> evoesap.store.a -> evoesap.store.b",
    ]


def test_at_most_a_dozen_modules_stay_at_the_top_of_the_package():
    top = sorted(p.name for p in (ROOT / "evoesap").glob("*.py"))
    assert len(top) <= 12, top


def test_every_node_of_the_picture_is_a_package_or_a_top_module():
    graph = _script()
    nodes = set(graph.node_graph(graph.module_imports()))
    packages = {p.name for p in (ROOT / "evoesap").iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in (ROOT / "evoesap").glob("*.py")} - {"__init__"}
    assert nodes == packages | modules | {graph.KFP}
    svg = (ROOT / "docs" / "packages.svg").read_text()
    labels = {n + "/" if n in packages else n for n in nodes}
    assert {label for label in labels if f">{label}<" in svg} == labels  # the picture in the docs is today's graph
