"""How the package installs: components/ and pipeline/ live inside the evoesap namespace."""

import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TEAM_SCRIPT = textwrap.dedent(
    """
    import sys
    from pipeline.dag import TEAM  # the team's own packages, not ours
    from components import TEAM_COMPONENTS
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.dag import compile_pipeline
    import evoesap.components, evoesap.pipeline

    config = load_config({"model": "m", "calibration_data": "c", "search_data": "s"})
    compile_pipeline(config, "spec.yaml")
    print(TEAM, TEAM_COMPONENTS, evoesap.pipeline.__file__, evoesap.components.__file__)
    """
)


def _team_repo(path: Path) -> Path:
    """A directory shaped like most KFP repositories: its own pipeline/ and components/ packages."""
    (path / "pipeline").mkdir(parents=True)
    (path / "pipeline" / "__init__.py").write_text("")
    (path / "pipeline" / "dag.py").write_text("TEAM = 'team-dag'\n")
    (path / "components").mkdir()
    (path / "components" / "__init__.py").write_text("TEAM_COMPONENTS = 'team-components'\n")
    (path / "team.py").write_text(TEAM_SCRIPT)
    return path


def test_installed_package_imports_beside_a_team_repo_with_its_own_pipeline_and_components(tmp_path):
    source, target = tmp_path / "source", tmp_path / "site"  # a copy: the build leaves nothing in the checkout
    for name in ("evoesap", "components", "pipeline"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    assert not (target / "pipeline").exists() and not (target / "components").exists()  # nothing top-level of ours
    assert (target / "evoesap" / "pipeline" / "dag.py").is_file()
    assert (target / "evoesap" / "components" / "prune.yaml").is_file()  # the single-stage components ship too
    team = _team_repo(tmp_path / "team")
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "team.py"], cwd=team, env=env, check=True, capture_output=True, text=True)
    team_dag, team_components, ours_pipeline, ours_components = out.stdout.split()
    assert (team_dag, team_components) == ("team-dag", "team-components")
    assert Path(ours_pipeline).parent == target / "evoesap" / "pipeline"
    assert Path(ours_components).parent == target / "evoesap" / "components"
    assert "exec-search" in (team / "spec.yaml").read_text()


def test_the_editable_checkout_maps_the_same_names_to_its_own_folders(tmp_path):
    """From a checkout (its editable install, as `make` does it) the names resolve to this checkout's
    folders, beside a team repository's own `pipeline` and `components`."""
    team = _team_repo(tmp_path / "team")
    out = subprocess.run([sys.executable, "team.py"], cwd=team, check=True, capture_output=True, text=True)
    team_dag, team_components, ours_pipeline, ours_components = out.stdout.split()
    assert (team_dag, team_components) == ("team-dag", "team-components")
    assert Path(ours_pipeline).parent == ROOT / "pipeline"
    assert Path(ours_components).parent == ROOT / "components"


def test_no_module_is_loaded_under_two_names():
    """The package never grafts the checkout onto its path, and nothing imports the top-level folders, so
    `pipeline.cluster` and `evoesap.pipeline.cluster` can never be two copies of one file."""
    import ast

    import evoesap

    assert list(evoesap.__path__) == [str(ROOT / "evoesap")]
    for path in [
        *ROOT.glob("evoesap/**/*.py"),
        *ROOT.glob("components/*.py"),
        *ROOT.glob("pipeline/*.py"),
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("examples/*.py"),
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            )
            assert not [n for n in names if n.split(".")[0] in ("pipeline", "components")], (path, names)


def test_pyproject_lists_every_package_of_the_source_tree():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "evoesap").rglob("__init__.py")}
    mapped = {name for name in setuptools["package-dir"]}
    assert set(setuptools["packages"]) == on_disk | mapped
    assert setuptools["package-dir"] == {"evoesap.components": "components", "evoesap.pipeline": "pipeline"}
