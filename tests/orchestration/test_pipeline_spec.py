"""The compiled KFP spec, the configuration schema, the images and the cluster submission request."""

import json
import re
from pathlib import Path

import pytest
import tomllib
import yaml
from evoesap.components import DEFAULT_IMAGE
from evoesap.components.kfp_artifacts import source
from evoesap.pipeline.config import PipelineConfig, load_config
from evoesap.pipeline.dag import compile_pipeline
from kfp import dsl
from tiny_world import quick_world_config

import evoesap
from evoesap.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _config(**overrides) -> PipelineConfig:
    values = dict(
        model="/models/full",
        calibration_data="/data/code.jsonl",
        search_data="/data/math.jsonl",
        criteria=["reap", "frequency"],
        sparsities=[0.25, 0.5],
        storage_root="s3://bucket/runs",
        resources={
            "search": {"accelerator_type": "nvidia.com/gpu", "accelerator_count": 2, "memory": "64G", "cpu": "8"},
            "evaluate": {"accelerator_type": "nvidia.com/gpu", "accelerator_count": 1},
            "prune": {"cpu": "4", "memory": "32G"},
        },
    )
    values.update(overrides)
    return PipelineConfig(**values)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = compile_pipeline(_config(heldout_data="/data/heldout.jsonl"), tmp_path_factory.mktemp("spec") / "pipeline.yaml")
    return yaml.safe_load(path.read_text())


def _stage(task: dict) -> str:
    return re.sub(r"^comp-|-\d+$", "", task["componentRef"]["name"])


def _dag(spec: dict, component: str) -> dict:
    return spec["components"][component]["dag"]["tasks"]


def _all_tasks(spec: dict) -> dict:
    """Every task of every DAG in the spec (root, sub-pipeline, loop), by component-qualified name."""
    dags = {"root": spec["root"]["dag"]["tasks"]}
    dags.update({name: c["dag"]["tasks"] for name, c in spec["components"].items() if "dag" in c})
    return {f"{where}/{name}": task for where, tasks in dags.items() for name, task in tasks.items()}


def test_compiled_spec_names_the_model_and_runs_the_dag_as_a_sub_pipeline(spec):
    root = spec["root"]["dag"]["tasks"]
    assert sorted(root) == ["evoesap-stages", "model-reference"]
    assert root["evoesap-stages"]["inputs"]["artifacts"]["model"]["taskOutputArtifact"]["producerTask"] == "model-reference"
    stages = _dag(spec, "comp-evoesap-stages")
    assert sorted(_stage(t) for t in stages.values()) == [
        "cache-logits",
        "cache-logits",
        "calibrate",
        "evaluate",
        "for-loop",
        "report",
    ]
    loop_name = next(n for n, t in stages.items() if _stage(t) == "for-loop")
    loop = stages[loop_name]
    assert set(loop["dependentTasks"]) == {"calibrate", "cache-logits", "cache-logits-2"}
    assert loop["parameterIterator"]["items"] == {"inputParameter": "pipelinechannel--grid"}
    grid = spec["root"]["inputDefinitions"]["parameters"]["grid"]["defaultValue"]
    assert grid == [{"criterion": c, "sparsity": s} for c in ("reap", "frequency") for s in (0.25, 0.5)]
    inner = _dag(spec, loop["componentRef"]["name"])
    assert sorted(_stage(t) for t in inner.values()) == [
        "evaluate",
        "evaluate",
        "prune",
        "prune",
        "search",
    ]
    searched_prune = next(n for n, t in inner.items() if _stage(t) == "prune" and t.get("dependentTasks") == ["search"])
    assert any(t.get("dependentTasks") == [searched_prune] for t in inner.values() if _stage(t) == "evaluate")
    for task in inner.values():  # the loop item's fields, never the item itself, reach the stages
        for name, value in task["inputs"].get("parameters", {}).items():
            if value.get("componentInputParameter") == "pipelinechannel--grid-loop-item":
                assert value["parameterExpressionSelector"] == f'parseJson(string_value)["{name}"]', name
    report = next(t for t in stages.values() if _stage(t) == "report")
    assert set(report["dependentTasks"]) == {"evaluate", loop_name}


_ARTIFACTS = {  # stage -> (input artifact classes, output artifact classes)
    "calibrate": (["Model"], ["Dataset"]),
    "cache-logits": (["Model"], ["Dataset"]),
    "search": (["Dataset", "Dataset", "Dataset", "Model"], ["Artifact"]),
    "prune": (["Artifact", "Dataset", "Model"], ["Model"]),
    "evaluate": (["Dataset", "Model"], ["Dataset", "Metrics"]),
    # + quantized, gates and a quality target's decisions (optional)
    "report": (["Artifact", "Artifact[]", "Artifact[]", "Dataset", "Dataset[]", "Dataset[]", "Dataset[]"], ["HTML", "Markdown"]),
}


def _classes(definitions: dict) -> list[str]:
    return sorted(
        a["artifactType"]["schemaTitle"].removeprefix("system.") + ("[]" if a.get("isArtifactList") else "")
        for a in definitions.get("artifacts", {}).values()
    )


def test_every_stage_takes_and_makes_artifacts_of_the_right_class(spec):
    seen = set()
    for name, component in spec["components"].items():
        stage = re.sub(r"^comp-|-\d+$", "", name)
        if stage not in _ARTIFACTS:
            continue
        seen.add(stage)
        inputs, outputs = _ARTIFACTS[stage]
        assert _classes(component["inputDefinitions"]) == inputs, stage
        assert _classes(component["outputDefinitions"]) == outputs, stage
    assert seen == set(_ARTIFACTS)
    # report (Markdown, HTML), the pruned models and their metrics, the full model's metrics
    assert _classes(spec["root"]["outputDefinitions"]) == ["HTML", "Markdown", "Metrics", "Metrics[]", "Model[]"]


def _producers(spec: dict, component: str, name: str) -> list[str]:
    """The component names (numbering dropped) of the task outputs that the DAG output `name` of `component` selects,
    followed through ParallelFor loops."""
    selectors = spec["components"][component]["dag"]["outputs"]["artifacts"][name]["artifactSelectors"]
    found = []
    for selector in selectors:
        task = spec["components"][component]["dag"]["tasks"][selector["producerSubtask"]]
        inner = task["componentRef"]["name"]
        if "dag" in spec["components"][inner]:
            found += _producers(spec, inner, selector["outputArtifactKey"])
        else:
            found.append(f"{_stage(task)}.{selector['outputArtifactKey']}")
    return found


def test_the_sub_pipeline_hands_on_quantized_models_releases_and_metrics_typed(tmp_path):
    config = _config(quantize={"recipe": "w4a16-gptq"}, publish_models=True, criteria=["reap"], sparsities=[0.5])
    spec = yaml.safe_load(compile_pipeline(config, tmp_path / "pipeline.yaml").read_text())
    outputs = spec["components"]["comp-evoesap-stages"]["outputDefinitions"]["artifacts"]
    kinds = {name: _classes({"artifacts": {name: value}})[0] for name, value in outputs.items()}
    assert kinds == {
        "report": "Markdown",
        "report_html": "HTML",
        "pruned_models": "Model[]",
        "pruned_metrics": "Metrics[]",
        "full_metrics": "Metrics",
        "quantized_models": "Model[]",
        "quantized_metrics": "Metrics[]",
        "released_models": "Model[]",
    }
    assert _classes(spec["root"]["outputDefinitions"]) == sorted(kinds.values())  # the standalone pipeline hands on all
    expected = {
        "pruned_models": ["prune.pruned"],
        "pruned_metrics": ["evaluate.metrics"],
        "full_metrics": ["evaluate.metrics"],
        "quantized_models": ["quantize.quantized"],
        "quantized_metrics": ["evaluate.metrics"],
        "released_models": ["publish.published"],
    }
    assert {name: _producers(spec, "comp-evoesap-stages", name) for name in expected} == expected
    tasks = spec["components"]["comp-evoesap-stages"]["dag"]["tasks"]
    full = spec["components"]["comp-evoesap-stages"]["dag"]["outputs"]["artifacts"]["full_metrics"]["artifactSelectors"]
    assert "model" in tasks[full[0]["producerSubtask"]]["inputs"]["artifacts"]  # the full model's evaluation


def test_the_sub_pipeline_hands_on_the_searched_prune_outputs_with_no_importer_in_the_loop(spec):
    """pruned_models: the searched prune task's own outputs, collected over the loop. No importer: a cluster's importer
    takes object-store URIs only, and an importer inside a ParallelFor is not supported there (kubeflow/pipelines#10860)."""
    stages_outputs = spec["components"]["comp-evoesap-stages"]["dag"]["outputs"]["artifacts"]
    (selector,) = stages_outputs["pruned_models"]["artifactSelectors"]
    loop = _dag(spec, "comp-evoesap-stages")[selector["producerSubtask"]]
    inner = _dag(spec, loop["componentRef"]["name"])
    searched_prune = next(n for n, t in inner.items() if t.get("dependentTasks") == ["search"])
    loop_outputs = spec["components"][loop["componentRef"]["name"]]["dag"]["outputs"]["artifacts"]
    (inner_selector,) = loop_outputs[selector["outputArtifactKey"]]["artifactSelectors"]
    assert inner_selector == {"outputArtifactKey": "pruned", "producerSubtask": searched_prune}
    assert not [name for name, e in spec["deploymentSpec"]["executors"].items() if "importer" in e]


def test_compiled_spec_carries_resources_and_retries_and_never_kfp_caching(spec):
    executors = spec["deploymentSpec"]["executors"]
    search = executors["exec-search"]["container"]
    assert search["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"
    assert search["resources"]["accelerator"]["resourceCount"] == "2"
    assert search["resources"]["resourceMemoryLimit"] == "64G"
    assert search["resources"]["resourceCpuLimit"] == "8"
    prune = executors["exec-prune"]["container"]
    assert "accelerator" not in prune["resources"]  # prune is CPU surgery: no GPU node for it
    assert all(e["container"]["image"] == DEFAULT_IMAGE for e in executors.values() if "container" in e)
    stage_tasks = {n: t for n, t in _all_tasks(spec).items() if _stage(t) in _ARTIFACTS}
    assert len(stage_tasks) == 10  # calibrate, 2 cache-logits, full evaluate, report, search, 2 prune, 2 evaluate
    for name, task in stage_tasks.items():
        assert task["retryPolicy"]["maxRetryCount"] == 2, name
    for name, task in _all_tasks(spec).items():  # the importer and the sub-pipeline too
        assert not task.get("cachingOptions", {}).get("enableCache", False), name  # our reuse checks storage
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["search_params"]["defaultValue"]["device_map"] == "auto"  # two GPUs: spread the model
    assert "device_map" not in params["evaluate_params"].get("defaultValue", {})  # one GPU: no sharding


def test_components_install_nothing_at_run_time(spec):
    for executor in spec["deploymentSpec"]["executors"].values():
        if "container" not in executor:
            continue  # the importer
        command = " ".join(executor["container"]["command"])
        assert "pip install" not in command


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"unknown_key": 1}, "unknown_key"),
        ({"sparsities": [0.0, 0.5]}, "sparsity"),
        ({"criteria": ["magnitude"]}, "criteria"),
        ({"resources": {"search": {"accelerator_count": 1}}}, "accelerator_type"),
        ({"resources": {"searchh": {"cpu": "2"}}}, "searchh"),
    ],
)
def test_bad_configuration_is_refused_with_the_offending_key(overrides, message):
    data = {"model": "m", "calibration_data": "c", "search_data": "s", **overrides}
    with pytest.raises(ConfigError, match=message):
        load_config(data)


def test_the_model_reaches_the_stages_as_a_reference_naming_it_at_its_revision(tmp_path):
    config = load_config({"model": "org/moe", "revision": "v1.0", "calibration_data": "c", "search_data": "s"})
    assert config.revision == "v1.0" and config.pinned_model == "org/moe@v1.0"
    spec = yaml.safe_load(compile_pipeline(config, tmp_path / "spec.yaml").read_text())
    assert spec["root"]["inputDefinitions"]["parameters"]["model"]["defaultValue"] == "org/moe@v1.0"
    assert "revision" not in spec["root"]["inputDefinitions"]["parameters"]
    # no importer anywhere near the full model: a cluster's importer takes object-store URIs only
    assert not [name for name in spec["root"]["dag"]["tasks"] if "importer" in name]
    reference = spec["root"]["dag"]["tasks"]["model-reference"]
    assert reference["inputs"]["parameters"] == {"model": {"componentInputParameter": "model"}}
    stages = next(t for name, t in spec["root"]["dag"]["tasks"].items() if name.endswith("-stages"))
    assert stages["inputs"]["artifacts"]["model"] == {
        "taskOutputArtifact": {"outputArtifactKey": "reference", "producerTask": "model-reference"}
    }


def test_a_model_reference_names_the_model_every_stage_then_reads(tmp_path):
    from evoesap.components.reference import model_reference
    from evoesap.components.trainjob import shared

    reference = dsl.Model(name="reference", uri=str(tmp_path / "reference"))
    model_reference("org/moe@v1.0", reference)
    assert json.loads(Path(reference.path).read_text()) == {"model": "org/moe@v1.0"}
    assert source(reference) == shared(reference) == "org/moe@v1.0"  # the name, never the JSON file KFP copied


def test_a_revision_for_a_model_that_is_not_a_hub_name_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="applies to hub models"):
        load_config({"model": str(tmp_path), "revision": "v1", "calibration_data": "c", "search_data": "s"})


def test_missing_configuration_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_images_components_and_pyproject_agree():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert project["version"] == evoesap.__version__
    assert DEFAULT_IMAGE.endswith(f":{evoesap.__version__}")
    torch_range = next(d for d in project["dependencies"] if d.startswith("torch"))
    makefile_torch = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    folders = ["evoesap", *pyproject["tool"]["setuptools"]["package-dir"].values()]
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (ROOT / "images" / dockerfile).read_text()
        assert f"ARG TORCH_VERSION={makefile_torch}" in text
        assert "pip install --no-deps . && pip check" in text  # the package; its dependencies from the hashed lock
        for name in folders:
            assert f"COPY {name} ./{name}" in text
    low, high = re.search(r">=([\d.]+),<([\d.]+)", torch_range).groups()
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(low) <= as_tuple(makefile_torch) < as_tuple(high)


def _loop(spec: dict) -> dict:
    """The criterion x sparsity ParallelFor task of the sub-pipeline."""
    (loop,) = [t for t in _dag(spec, "comp-evoesap-stages").values() if "parameterIterator" in t]
    return loop


@pytest.mark.parametrize("parallelism", [0, 2])
def test_parallelism_bounds_the_fan_out_in_the_compiled_iterator_policy(tmp_path, parallelism):
    path = compile_pipeline(_config(parallelism=parallelism), tmp_path / "pipeline.yaml")
    loop = _loop(yaml.safe_load(path.read_text()))
    assert loop["parameterIterator"]["itemInput"]  # the loop runs over the grid
    if parallelism:
        assert loop["iteratorPolicy"] == {"parallelismLimit": parallelism}
    else:  # unbounded: every point at once, KFP's default
        assert "iteratorPolicy" not in loop


@pytest.mark.parametrize(
    ("sparsity", "why"),
    [
        (0.5, r"budget 4 admits a single allocation \(2, 2\): there is nothing to search"),
        (0.75, r"budget 6 is above sum\(n - k\) = 4"),
    ],
)
def test_an_infeasible_sparsity_is_refused_at_compile_in_one_line(tmp_path, capsys, sparsity, why):
    from evoesap.cli import main

    model = quick_world_config(tmp_path / "quick")
    config = tmp_path / "pipeline.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **_config().model_dump(include={"calibration_data", "search_data", "storage_root"}),
                "model": str(model),
                "criteria": ["reap"],
                "sparsities": [0.25, sparsity],
            }
        )
    )
    out = tmp_path / "spec.yaml"
    assert main(["pipeline", "compile", str(config), "-o", str(out)]) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert re.match(
        rf"error: criterion reap at sparsity {sparsity} cannot be searched on {model} .*{why}.*"
        r"remove it from sparsities$",
        line,
    ), line
    assert not out.exists()


def test_a_multimodal_checkpoint_compiles_its_fan_out_checked_against_its_language_model(tmp_path, capsys):
    """Every point of the fan-out is searched: a multimodal checkpoint's points are checked against its language
    model's experts (25% of 8 experts top 2: feasible), from config.json alone."""
    from evoesap import moe
    from evoesap.cli import main

    model = tmp_path / "multimodal"
    moe.tiny_model("qwen3_vl_moe").config.save_pretrained(model)
    config = tmp_path / "pipeline.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **_config().model_dump(include={"calibration_data", "search_data", "storage_root"}),
                "model": str(model),
                "criteria": ["reap"],
                "sparsities": [0.25],
            }
        )
    )
    out = tmp_path / "spec.yaml"
    assert main(["pipeline", "compile", str(config), "-o", str(out)]) == 0, capsys.readouterr().err
    assert out.read_text().startswith("# PIPELINE DEFINITION")


def test_every_feasible_sparsity_compiles_and_an_unreadable_model_is_left_to_the_stages(tmp_path, caplog):
    model = quick_world_config(tmp_path / "quick")
    compile_pipeline(_config(model=str(model), sparsities=[0.25]), tmp_path / "a.yaml")  # 3 allocations: searchable
    compile_pipeline(_config(model="/models/on-the-cluster-only", sparsities=[0.5]), tmp_path / "b.yaml")
    assert "not checked against /models/on-the-cluster-only" in caplog.text


def test_compile_set_bakes_checked_parameter_defaults_and_a_bad_one_writes_nothing(tmp_path, capsys):
    """`pipeline compile --set` takes submit's pairs: the compiled defaults carry them (a stage field on top of the
    configured ones); a value the stage refuses stops before anything is written at --output."""
    from evoesap.cli import main

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(_config().model_dump(mode="json", exclude_none=True)))
    out = tmp_path / "spec.yaml"
    sets = ["--set", "search_params.generations=7", "--set", "storage_root=s3://other/runs"]
    assert main(["pipeline", "compile", str(config), "-o", str(out), *sets]) == 0
    text = out.read_text()
    assert text.startswith("# PIPELINE DEFINITION\n") and "# --set search_params.generations=7\n" in text
    spec, *_ = yaml.safe_load_all(text)
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    plain = tmp_path / "plain.yaml"
    assert main(["pipeline", "compile", str(config), "-o", str(plain)]) == 0
    compiled = next(yaml.safe_load_all(plain.read_text()))["root"]["inputDefinitions"]["parameters"]
    assert parameters["search_params"]["defaultValue"] == {**compiled["search_params"]["defaultValue"], "generations": 7}
    assert {k: v for k, v in parameters.items() if k not in ("search_params", "storage_root")} == {
        k: v for k, v in compiled.items() if k not in ("search_params", "storage_root")
    }
    assert parameters["storage_root"]["defaultValue"] == "s3://other/runs"
    assert main(["pipeline", "compile", str(config), "-o", str(out), "--set", "search_params.generations=7"]) == 0  # its own file
    capsys.readouterr()
    fresh = tmp_path / "fresh.yaml"
    assert main(["pipeline", "compile", str(config), "-o", str(fresh), "--set", "search_params.generations=-1"]) != 0
    assert "generations" in capsys.readouterr().err and not fresh.exists()
    assert not list(tmp_path.glob(".fresh.yaml.partial-*"))


def test_a_configuration_nested_too_deeply_is_refused_in_one_line(tmp_path):
    path = tmp_path / "pipeline.yaml"
    path.write_text("model: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="pipeline.yaml nests too deeply to read") as refused:
        load_config(path)
    assert "\n" not in str(refused.value)


def test_the_task_that_ends_a_run_on_a_failed_gate_is_never_retried_while_the_stages_are(tmp_path):
    config = _config(heldout_data="/data/heldout.jsonl", publish_models=True, gate={"min_heldout_esap": 0.9})
    spec = yaml.safe_load(compile_pipeline(config, tmp_path / "pipeline.yaml").read_text())
    tasks = _all_tasks(spec)
    (check,) = [t for t in tasks.values() if t["taskInfo"]["name"] == "release gate"]
    assert check.get("retryPolicy", {}).get("maxRetryCount", 0) == 0  # a refusal only repeats itself
    gates = [t for t in tasks.values() if _stage(t) == "gate"]
    assert gates and all(t["retryPolicy"]["maxRetryCount"] == 2 for t in gates)  # the gate stage keeps its retries


@pytest.mark.parametrize("stop_on_fail", [True, False])
def test_a_gated_pipeline_hands_on_its_verdict_and_reads_stop_on_fail_at_run_time(tmp_path, stop_on_fail):
    gate = {"min_heldout_esap": 0.9, "stop_on_fail": stop_on_fail}
    config = _config(heldout_data="/data/heldout.jsonl", publish_models=True, gate=gate)
    spec = yaml.safe_load(compile_pipeline(config, tmp_path / "pipeline.yaml").read_text())
    assert spec["root"]["outputDefinitions"]["parameters"]["verdict"]["parameterType"] == "STRING"
    (check,) = [t for t in _all_tasks(spec).values() if t["taskInfo"]["name"] == "release gate"]
    # whatever the configuration says, the task is there and takes gate_params, whose stop_on_fail a run may change
    assert check["inputs"]["parameters"]["params"]["componentInputParameter"].endswith("gate_params")


def test_a_gated_pipeline_hands_on_released_models_from_a_publish_under_no_condition(tmp_path):
    """publish decides from the verdict itself (a withheld entry on a failing one), so it runs under no condition and
    its outputs are collected out of the loop: `released_models` is an output of a gated pipeline too."""
    config = _config(heldout_data="/data/heldout.jsonl", publish_models=True, gate={"min_heldout_esap": 0.9})
    spec = yaml.safe_load(compile_pipeline(config, tmp_path / "pipeline.yaml").read_text())
    outputs = spec["components"]["comp-evoesap-stages"]["outputDefinitions"]["artifacts"]
    assert _classes({"artifacts": {"released_models": outputs["released_models"]}}) == ["Model[]"]
    assert _producers(spec, "comp-evoesap-stages", "released_models") == ["publish.published"]
    assert "released_models" in spec["root"]["outputDefinitions"]["artifacts"]
    tasks = _all_tasks(spec)
    (publish,) = [t for t in tasks.values() if _stage(t) == "publish"]
    assert "triggerPolicy" not in publish and not [t for t in tasks.values() if "condition" in t.get("triggerPolicy", {})]
    (gate,) = [name.rsplit("/", 1)[1] for name, t in tasks.items() if _stage(t) == "gate"]
    assert publish["inputs"]["artifacts"]["gate"]["taskOutputArtifact"] == {"outputArtifactKey": "verdict", "producerTask": gate}
