"""examples/: the configurations compile, and a team pipeline train -> EvoESAP -> publish runs with kfp.local."""

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import yaml

import evoesap
from evoesap.store import artifacts
from evoesap import moe
from evoesap.records.facts import facts
from evoesap.errors import ConfigError
from evoesap.pipeline.config import load_config
from evoesap.pipeline.dag import compile_pipeline
from evoesap.pipeline.run import run_local
from tiny_world import make_tiny_inputs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples").glob("*.yaml"))


def _team_module():
    spec = importlib.util.spec_from_file_location("team_pipeline", ROOT / "examples" / "team_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_cover_the_demo_and_the_papers_models():
    assert [p.stem for p in CONFIGS] == [
        "deepseek-v2-lite",
        "deepseek-v3",
        "demo-math",
        "demo",
        "mixtral-8x7b",
        "olmoe-1b-7b-instruct",
        "qwen3-235b-a22b",
        "qwen3-30b-a3b",
    ]


@pytest.mark.parametrize("name,fits", [("mixtral-8x7b", True), ("qwen3-235b-a22b", True), ("deepseek-v3", False)])
def test_the_scale_out_examples_plan_offline_from_their_shipped_config(name, fits, capsys, monkeypatch):
    """`evoesap plan` prints the per-GPU table of each scale-out example without asking the hub; DeepSeek-V3 in
    bfloat16 is larger than two nodes of eight 80 GB GPUs, and the plan says so."""
    from evoesap.store import identity
    from evoesap.cli import main

    def offline(*args, **kwargs):
        raise AssertionError("the plan asked the hub")

    monkeypatch.setattr(identity, "resolve_revision", offline)
    monkeypatch.chdir(ROOT)
    gpus = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())["resources"]["search"]["accelerator_count"]
    code = main(["plan", f"examples/{name}.yaml", "--model-config", f"examples/models/{name}", "--gpu-memory", "80GB"])
    table = capsys.readouterr().out
    assert "| stage | host GiB | per-GPU GiB |" in table and "| search |" in table
    assert (code == 0) == fits
    search = next(line for line in table.splitlines() if line.startswith("| search |"))
    per_gpu = float(search.split("|")[3])
    assert (per_gpu <= 80e9 / 2**30) == fits and gpus > 1


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_example_configuration_is_documented_and_compiles(path, tmp_path):
    text = path.read_text()
    assert len(re.findall(r"^# \S", text, flags=re.M)) >= 2, f"{path.name} needs a comment saying what it runs"
    spec, *platform = yaml.safe_load_all(
        compile_pipeline(load_config(path), tmp_path / "spec.yaml").read_text()
    )  # Kubernetes settings: a second document
    assert spec["pipelineInfo"]["name"] == yaml.safe_load(text)["name"]


DOC_PAGES = [ROOT / "README.md", ROOT / "docs" / "guides" / "configure.md", ROOT / "docs" / "getting-started" / "first-model.md"]


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_documented_configuration_blocks_compile(page, tmp_path):
    blocks = re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S)
    configs = [yaml.safe_load(b) for b in blocks if "storage_root" in b]
    assert configs, f"{page.name} lost its pipeline configuration example"
    for config in configs:
        compile_pipeline(load_config(config), tmp_path / "readme.yaml")


def _images(text: str) -> set[str]:
    """Every image a compiled spec or component YAML names (each `image:` field, wherever it is)."""
    return set(re.findall(r"^\s*image: (\S+)", text, flags=re.M))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_with_a_registry_set_every_compiled_image_lies_in_it(path, tmp_path):
    """Pipeline, team example and component YAMLs compiled from one configuration with `registry` set."""
    from evoesap.cli import main

    registry = "registry.internal:5000/ml"
    data = yaml.safe_load(path.read_text())
    data = {k: v for k, v in data.items() if k != "image"}  # the examples' own image names their example registry
    for settings in data.get("resources", {}).values():
        settings.pop("image", None)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump({**data, "registry": registry}))
    config = load_config(config_path)
    pipeline = compile_pipeline(config, tmp_path / "pipeline.yaml").read_text()
    from kfp import compiler

    compiler.Compiler().compile(_team_module().build_team_pipeline(config), str(tmp_path / "team.yaml"))
    assert main(["pipeline", "components", "--out", str(tmp_path / "components"), "--config", str(config_path)]) == 0
    texts = [pipeline, (tmp_path / "team.yaml").read_text(), *(p.read_text() for p in (tmp_path / "components").glob("*.yaml"))]
    from evoesap.registry import STAGES

    assert len(texts) == 2 + len(STAGES)  # the pipeline, the team pipeline, one component per stage
    for text in texts:
        assert _images(text) == {f"{registry}/stage:{evoesap.__version__}"}, _images(text)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"image": "evoesap/stage:0.1.0"}, "image 'evoesap/stage:0.1.0' is not fully qualified"),
        ({"image": "registry.example.org/evoesap/stage"}, "not fully qualified"),
        ({"registry": "registry.internal/ml", "image": "ghcr.io/x/stage:1"}, "is not in the registry 'registry.internal/ml'"),
        (
            {"registry": "registry.internal/ml", "resources": {"prune": {"image": "docker.io/x/cpu:1"}}},
            "resources.prune.image 'docker.io/x/cpu:1' is not in the registry",
        ),
    ],
)
def test_an_unqualified_or_foreign_image_is_refused(settings, message):
    base = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    with pytest.raises(ConfigError, match=message):
        load_config({**base, **settings})


def test_team_pipeline_compiles_with_evoesap_as_a_sub_pipeline(tmp_path):
    from kfp import compiler

    team = _team_module()
    compiler.Compiler().compile(
        team.build_team_pipeline(load_config(ROOT / "examples" / "demo.yaml")), str(tmp_path / "team.yaml")
    )
    spec = yaml.safe_load((tmp_path / "team.yaml").read_text())
    root = spec["root"]["dag"]["tasks"]
    assert set(root) == {"train", "evoesap-demo-stages", "publish"}
    model = root["evoesap-demo-stages"]["inputs"]["artifacts"]["model"]["taskOutputArtifact"]
    assert model == {"outputArtifactKey": "model", "producerTask": "train"}
    handed = root["publish"]["inputs"]["artifacts"]["pruned_models"]["taskOutputArtifact"]
    assert handed == {"outputArtifactKey": "pruned_models", "producerTask": "evoesap-demo-stages"}


@pytest.fixture(scope="module")
def team_run(tmp_path_factory):
    """The team pipeline on the tiny demo-world model, kfp.local's own task cache on as a team might run it."""
    root = tmp_path_factory.mktemp("team")
    files = make_tiny_inputs(root / "inputs")
    config = load_config(
        {
            "name": "team",
            "model": files["model"],
            "calibration_data": files["calibration"],
            "search_data": files["search"],
            "criteria": ["reap"],
            "sparsities": [0.5],
            "storage_root": str(root / "artifacts"),
            "pipeline_root": str(root / "kfp"),
            "calibrate": {"samples": 8, "max_length": 128},
            "cache_logits": {"samples": 8, "max_length": 128, "dtype": "float32"},
            "search": {"population": 4, "elites": 2, "generations": 1, "batch_size": 8},
            "evaluate": {"tasks": [files["tasks"]], "limit": 2, "batch_size": 4},
        }
    )
    team = _team_module()

    def run():
        return run_local(config, build=team.build_team_pipeline, arguments={"train_data": files["calibration"]}, kfp_caching=True)

    return {"run": run, "first": run(), "root": root, "base": files["model"]}


def test_team_pipeline_publishes_the_pruned_models_it_was_handed(team_run):
    first = team_run["first"]
    (model,) = first["pruned_models"]  # the searched prune output: under kfp.local its URI is the stored checkpoint
    uri = model.uri
    assert model.path == uri and Path(uri).parent.name == "prune" and (Path(uri) / "model.safetensors").is_file()
    record = facts(uri)
    assert record["stage"] == "prune" and record["method"] == "searched"
    kept = list(moe.inspect(moe.load_pruned(uri)).num_experts)  # the checkpoint itself, loaded independently
    release = first["release"]
    (published,) = release.metadata["models"]
    assert published == {"uri": uri, "expert_counts": kept}
    assert f"experts per layer {kept}" in Path(release.path).read_text()
    trained = artifacts.read_manifest(uri).inputs["model"]["uri"]
    assert trained != team_run["base"] and Path(trained).is_dir()  # pruned from the train step's output
    allocation = artifacts.read_json(artifacts.join(record["inputs"]["allocation"], "allocation.json"))
    assert [n - r for n, r in zip(allocation["num_experts"], allocation["removal_counts"])] == kept


def test_deleted_checkpoint_and_report_are_made_again_not_reported_from_a_cache(team_run):
    (model,) = team_run["first"]["pruned_models"]
    pruned_dir = Path(model.uri)
    first_model = facts(str(pruned_dir))["inputs"]["model"]
    report_dir = team_run["root"] / "artifacts" / "report" / _only(team_run, "report")
    calibrate_dir = team_run["root"] / "artifacts" / "calibrate" / _only(team_run, "calibrate")
    calibrated = artifacts.read_manifest(str(calibrate_dir)).started
    shutil.rmtree(pruned_dir)
    shutil.rmtree(report_dir)
    second = team_run["run"]()
    (again,) = second["pruned_models"]
    assert again.uri == str(pruned_dir)  # same inputs, same content address
    assert artifacts.read_manifest(str(pruned_dir)).stage == "prune"  # it exists again, made again
    assert list(moe.inspect(moe.load_pruned(str(pruned_dir))).num_experts) == facts(again.path)["expert_counts"]
    # The re-made checkpoint has a new manifest, so its evaluation and the report are made again, at their
    # new content addresses; the report the release names exists.
    report_line = next(line for line in Path(second["release"].path).read_text().splitlines() if line.startswith("Report: "))
    report = Path(report_line.removeprefix("Report: "))
    assert report != report_dir and (report / "report.md").is_file()
    # The team's train step came from kfp.local's cache (its output still exists), so EvoESAP saw the same
    # model and reused every stage whose output was untouched.
    assert artifacts.read_manifest(str(pruned_dir)).inputs["model"]["uri"] == first_model
    assert artifacts.read_manifest(str(calibrate_dir)).started == calibrated


def _only(team_run, stage: str) -> str:
    (name,) = [p.name for p in (team_run["root"] / "artifacts" / stage).iterdir() if (p / "manifest.json").exists()]
    return name
