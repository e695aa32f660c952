"""examples/: the configurations compile, and a team pipeline train -> EvoESAP -> release_notes runs with kfp.local."""

import re
import shutil
from pathlib import Path

import pytest
import yaml
from evoesap.pipeline.config import load_config
from evoesap.pipeline.dag import compile_pipeline
from evoesap.pipeline.run import run_local
from scripts import load_script
from tiny_world import make_tiny_inputs

import evoesap
from evoesap import moe
from evoesap.errors import ConfigError
from evoesap.records.facts import facts, task_scores
from evoesap.store import artifacts

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples").glob("*.yaml"))


def _team_module():
    return load_script("examples/team_pipeline.py")


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
    from evoesap.cli import main
    from evoesap.store import identity

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
    assert set(root) == {"train", "evoesap-demo-stages", "release-notes"}
    model = root["evoesap-demo-stages"]["inputs"]["artifacts"]["model"]["taskOutputArtifact"]
    assert model == {"outputArtifactKey": "model", "producerTask": "train"}
    for name in ("pruned_models", "pruned_metrics"):
        handed = root["release-notes"]["inputs"]["artifacts"][name]["taskOutputArtifact"]
        assert handed == {"outputArtifactKey": name, "producerTask": "evoesap-demo-stages"}


def test_the_embedding_guide_names_every_output_the_sub_pipeline_hands_on():
    """docs/guides/embed.md lists what a team's pipeline receives; with quantize and publish on, every output is there."""
    from evoesap.pipeline.dag import outputs_type

    demo = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    config = load_config({**demo, "quantize": {"recipe": "w4a16-gptq"}, "publish_models": True})
    names = set(outputs_type(config)._fields)
    assert {"quantized_models", "released_models", "full_metrics"} <= names  # the optional ones are in the set
    guide = (ROOT / "docs" / "guides" / "embed.md").read_text()
    assert {name for name in names if f"`{name}`" not in guide} == set()
    assert "use_venv=False" in guide  # the local runner a team's own pipeline needs


def _team_config(files: dict, root: Path, **extra):
    """The team pipeline's configuration at the tiny world's sizes, storage and KFP root under `root`."""
    return load_config(
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
            **extra,
        }
    )


@pytest.fixture(scope="module")
def team_run(tmp_path_factory):
    """The team pipeline on the tiny demo-world model, kfp.local's own task cache on as a team might run it."""
    root = tmp_path_factory.mktemp("team")
    files = make_tiny_inputs(root / "inputs")
    config = _team_config(files, root)
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
    evaluated = [p for p in (team_run["root"] / "artifacts" / "evaluate").iterdir() if (p / "manifest.json").is_file()]
    (evaluation,) = [p for p in evaluated if artifacts.read_manifest(str(p)).inputs["model"]["uri"] == uri]
    scores = task_scores(str(evaluation))  # the pruned model's own evaluation, found in storage
    assert published == {"uri": uri, "expert_counts": kept, "scores": scores} and scores
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
    evaluated = {p: p.stat().st_mtime_ns for p in (team_run["root"] / "artifacts" / "evaluate").glob("*/manifest.json")}
    shutil.rmtree(pruned_dir)
    shutil.rmtree(report_dir)
    second = team_run["run"]()
    (again,) = second["pruned_models"]
    assert again.uri == str(pruned_dir)  # same inputs, same content address
    assert artifacts.read_manifest(str(pruned_dir)).stage == "prune"  # it exists again, made again
    assert list(moe.inspect(moe.load_pruned(str(pruned_dir))).num_experts) == facts(again.path)["expert_counts"]
    # The re-made checkpoint has a new manifest but the same content: its evaluations are reused (their lineage
    # checks the checkpoint by content), and the deleted report is made again at its same content address, which
    # the release names.
    after = {p: p.stat().st_mtime_ns for p in (team_run["root"] / "artifacts" / "evaluate").glob("*/manifest.json")}
    assert after == evaluated
    report_line = next(line for line in Path(second["release"].path).read_text().splitlines() if line.startswith("Report: "))
    report = Path(report_line.removeprefix("Report: "))
    assert report == report_dir and (report / "report.md").is_file()
    # The team's train step came from kfp.local's cache (its output still exists), so EvoESAP saw the same
    # model and reused every stage whose output was untouched.
    assert artifacts.read_manifest(str(pruned_dir)).inputs["model"]["uri"] == first_model
    assert artifacts.read_manifest(str(calibrate_dir)).started == calibrated


def _only(team_run, stage: str) -> str:
    (name,) = [p.name for p in (team_run["root"] / "artifacts" / stage).iterdir() if (p / "manifest.json").exists()]
    return name


def _tree_digest(path: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_release_run_with_the_same_model_at_a_new_uri_reuses_every_stage(tmp_path):
    """Two runs of the team pipeline without kfp.local's cache, as two scheduled release runs: the train step runs
    again and writes a byte-identical model at a new URI; EvoESAP's second run makes nothing again (its log
    says it reused calibrate, both teacher caches, the search, the prunes and evaluations)."""
    files = make_tiny_inputs(tmp_path / "inputs")
    config = _team_config(files, tmp_path, heldout_data=files["heldout"])
    team = _team_module()
    runs = []
    for n in (1, 2):
        log = tmp_path / f"run-{n}.log"
        outputs = run_local(config, log, build=team.build_team_pipeline, arguments={"train_data": files["calibration"]})
        (model,) = outputs["pruned_models"]
        trained = artifacts.read_manifest(model.uri).inputs["model"]["uri"]
        runs.append({"log": log.read_text(), "model": model.uri, "trained": Path(trained)})
    first, second = runs
    assert first["model"] == second["model"]  # the same content address
    stored = artifacts.read_manifest(second["model"]).inputs["model"]["uri"]
    assert stored == str(first["trained"])  # reused: its record still names the model it was made from
    trained_again = sorted((tmp_path / "kfp").glob("*/train/model"))
    assert len(trained_again) == 2 and trained_again[0] != trained_again[1]  # the train step ran twice, two URIs
    assert _tree_digest(trained_again[0]) == _tree_digest(trained_again[1])  # byte-identical
    reused = re.findall(r"(\S+): reusing the finished artifact at", second["log"])
    assert sorted(reused) == sorted(["calibrate", "cache-logits", "cache-logits", "search", "prune", "prune", "evaluate",
                                     "evaluate", "evaluate", "report"]), reused  # fmt: skip
    assert not re.findall(r"(\S+): reusing the finished artifact at", first["log"])


def image_layout(dockerfile: Path) -> dict[str, set[str]]:
    """What an image holds, read from its Dockerfile: the venvs it creates, and every directory it creates or copies
    into (venvs, WORKDIRs, COPY destinations), plus the absolute paths its ENV names."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    venvs = set(re.findall(r"python3? -m venv (/\S+)", text))
    dirs, workdir = set(venvs), "/"
    for instruction, argument in re.findall(r"^(WORKDIR|COPY) (.*)$", text, flags=re.M):
        if instruction == "WORKDIR":
            workdir = argument.strip()
            dirs.add(workdir)
        else:
            dest = argument.split()[-1]
            dirs.add(str(Path(workdir) / dest))
    env = set(re.findall(r"\b[A-Z_]+=(/[^\s:$]+)", " ".join(re.findall(r"^ENV (.*)$", text, flags=re.M))))
    return {"venvs": venvs, "dirs": dirs, "env": env}


def _image_path_problem(path: str, layout: dict[str, set[str]]) -> str | None:
    python = re.match(r"(.*)/bin/python[\d.]*$", path)
    if python:
        return None if python.group(1) in layout["venvs"] else f"{path}: the image has no venv at {python.group(1)}"
    inside = any(path == d or path.startswith(d.rstrip("/") + "/") for d in layout["dirs"] | layout["env"])
    return None if inside else f"{path}: the image neither creates nor copies anything there"


def test_the_images_layout_is_read_from_their_dockerfiles():
    for name in ("Dockerfile", "Dockerfile.cuda"):
        layout = image_layout(ROOT / "images" / name)
        assert {"/opt/venv", "/opt/vllm", "/opt/quantize"} <= layout["venvs"], layout
        assert "/opt/quantize/bin/python" in layout["env"] and "/opt/evoesap" in layout["dirs"]
        assert _image_path_problem("/opt/venv-quantize/bin/python", layout) is not None  # the path an example once named
        assert _image_path_problem("/opt/quantize/bin/python", layout) is None


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_image_path_an_example_names_exists_in_the_image_its_stage_runs(path):
    """Absolute paths in a stage's environment (an interpreter, a directory) must be in the image that stage runs:
    images/Dockerfile.cuda for a `stage-cuda` image, images/Dockerfile otherwise."""
    config = load_config(path)
    layouts = {name: image_layout(ROOT / "images" / name) for name in ("Dockerfile", "Dockerfile.cuda")}
    checked = 0
    for stage, settings in config.resources.items():
        image = config.stage_image(stage) if stage != "all" else config.default_image
        layout = layouts["Dockerfile.cuda" if "/stage-cuda:" in image else "Dockerfile"]
        for variable, value in (settings.env or {}).items():
            if str(value).startswith("/"):
                checked += 1
                assert _image_path_problem(str(value), layout) is None, f"resources.{stage}.env.{variable}"
    if path.stem == "olmoe-1b-7b-instruct":
        assert checked, "the example's quantize interpreter was not checked"


def test_local_runs_run_each_step_in_this_environment_not_a_fresh_venv(monkeypatch, tmp_path):
    """KFP's SubprocessRunner() defaults to use_venv=True: each step in a new venv without EvoESAP, where the first
    step fails ("No module named 'kfp.dsl'"). run_local, the helper docs/guides/embed.md shows for team pipelines, turns
    it off."""
    from kfp import local

    seen = {}

    class Stop(Exception):
        pass

    def init(runner, **kwargs):
        seen["runner"] = runner
        raise Stop

    monkeypatch.setattr(local, "init", init)
    demo = {k: v for k, v in yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text()).items() if k != "quantize"}
    config = load_config({**demo, "model": "org/name"})
    with pytest.raises(Stop):
        run_local(config, build=_team_module().build_team_pipeline, arguments={"train_data": "x"})
    assert isinstance(seen["runner"], local.SubprocessRunner) and seen["runner"].use_venv is False
    assert local.SubprocessRunner().use_venv is True  # KFP's own default, the reason for the above
