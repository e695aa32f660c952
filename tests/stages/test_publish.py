"""The publish stage: the model card parsed and traced to the artifacts, pushes to a local
fsspec target (byte-identical) and to a recording Hub server on 127.0.0.1 (expected requests, no token
anywhere), and bad inputs refused in one line before any work."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import re
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from huggingface_hub.errors import RepositoryNotFoundError
from tiny_artifacts import PRUNE, evaluate_params

from evoesap import records
from evoesap.cli import main
from evoesap.errors import ConfigError
from evoesap.reporting import card
from evoesap.stages.evaluate import run_evaluate
from evoesap.stages.prune import run_prune
from evoesap.stages.publish import PublishParams, run_publish
from evoesap.store import artifacts

TOKEN = "hf_secret_token_for_tests_0123456789"
BASE = "allenai/OLMoE-1B-7B-0125-Instruct"


@pytest.fixture(scope="module")
def world(tiny_artifacts, tmp_path_factory) -> dict[str, str]:
    """The tiny artifacts plus the full model's evaluation, and a second pruned model (from a copy of the base
    whose card names a license) with its evaluation."""
    root = tmp_path_factory.mktemp("publish-world")
    out = dict(tiny_artifacts)
    out["evaluated_full"] = str(root / "evaluated_full")
    run_evaluate(out["model"], evaluate_params(out["tasks"], method="full"), out["evaluated_full"])
    licensed = root / "licensed-model"
    shutil.copytree(out["model"], licensed)
    (licensed / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: [en]\n---\n# A base model\n")
    out["licensed_pruned"], out["licensed_evaluated"] = str(root / "licensed_pruned"), str(root / "licensed_evaluated")
    run_prune(str(licensed), out["scores"], PRUNE, out["licensed_pruned"], allocation=out["search_out"])
    run_evaluate(out["licensed_pruned"], evaluate_params(out["tasks"], method="searched"), out["licensed_evaluated"])
    return out


def _publish(world: dict[str, str], out: Path, params: PublishParams = PublishParams(), **extra: Any) -> str:  # noqa: B008 - frozen
    run_publish(
        world["pruned"],
        [world["evaluated"], world["evaluated_full"]],
        params,
        str(out),
        search=world["search_out"],
        report=world["report"],
        **extra,
    )
    return (out / "README.md").read_text()


def _split_card(text: str) -> tuple[dict[str, Any], str]:
    match = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.S)
    assert match, "the card must open with a YAML metadata block"
    return yaml.safe_load(match.group(1)), match.group(2)


def _table(body: str, header_start: str) -> list[list[str]]:
    """The rows of the Markdown table whose header starts with `header_start`, cells stripped and unescaped."""
    lines = body.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header_start}"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().replace("\\", "").strip("`") for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def _lineage_contents(uris: list[str]) -> dict[str, str]:
    """Every artifact reached from `uris` through manifest inputs -> its content identity (the sha256 of its stage,
    cache key and payload files' sha256 as sorted JSON), by hand."""
    found, todo = {}, list(uris)
    while todo:
        uri = todo.pop()
        if uri in found:
            continue
        manifest = json.loads(Path(uri, "manifest.json").read_text())
        content = {k: manifest[k] for k in ("stage", "cache_key", "files")}
        found[uri] = artifacts.sha256_bytes(json.dumps(content, sort_keys=True).encode())
        inputs = manifest["inputs"]
        todo += [e["uri"] for e in inputs.values() if e.get("kind") == "artifact"]
    return found


def test_card_metadata_is_the_hubs_and_every_number_comes_from_an_artifact(world, tmp_path):
    from huggingface_hub import ModelCard

    text = _publish(world, tmp_path / "published", PublishParams(show_locations=True))
    meta, body = _split_card(text)
    assert ModelCard(text).data.to_dict() == meta  # huggingface_hub reads the same header
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    pruning = records.read(world["pruned"], records.PruningRecord).to_json()
    pruned_eval = records.read(world["evaluated"], records.MetricsRecord).to_json()
    full_eval = records.read(world["evaluated_full"], records.MetricsRecord).to_json()
    assert {"evoesap", "mixture-of-experts", pruning["criterion"], pruned_eval["experts"]["family"]} <= set(meta["tags"])
    assert "base_model" not in meta and "license" not in meta  # a local base, no card: nothing invented

    experts = _table(body, "MoE layer")
    assert [[int(c) for c in row] for row in experts] == [
        [
            i,
            pruned_eval["experts"]["decoder_index"][i],
            full_eval["experts"]["num_experts"][i],
            kept,
            pruning["removal_counts"][i],
            pruned_eval["experts"]["top_k"][i],
        ]
        for i, kept in enumerate(pruning["num_experts"])
    ]
    evaluation = _table(body, "Task")
    primary = [r for r in pruned_eval["records"] if r["primary"]]
    assert [row[:2] for row in evaluation] == [[r["task"], r["metric"]] for r in primary]
    for row, rec in zip(evaluation, primary):
        base = next(
            r
            for r in full_eval["records"]
            if (r["task"], r["metric"], r["filter"]) == (rec["task"], rec["metric"], rec["filter"])
        )
        for cell, source in ((row[2], base), (row[3], rec)):
            value, stderr = (float(x) for x in cell.split("±"))
            assert abs(value - source["value"]) <= 5e-4 and abs(stderr - source["stderr"]) <= 5e-4
        assert abs(float(row[4]) - (rec["value"] - base["value"])) <= 5e-4
        assert int(row[5]) == rec["samples"]
    memory = {row[0]: row for row in _table(body, "Model")}
    assert int(memory["Full"][1].replace(",", "")) == full_eval["memory"]["parameters"]
    assert int(memory["Pruned"][2].replace(",", "")) == pruning["parameter_bytes_pruned"]
    assert int(memory["Full"][2].replace(",", "")) == pruning["parameter_bytes_full"]
    allocation = records.read(world["search_out"], records.AllocationRecord).to_json()
    assert f"{allocation['fitness']:.6f}" in body and f"{allocation['heldout']['searched']:.6f}" in body
    assert "## Quantization" in body and "None: the weights are stored in" in body  # no recipe in config.json

    # lineage: every artifact behind the card with its content identity, found here by walking manifests by hand
    shown = {row[0]: row[3] for row in _table(body, "Artifact")}
    inputs = [world[k] for k in ("pruned", "evaluated", "evaluated_full", "search_out", "report")]
    assert shown == _lineage_contents(inputs)
    sources = {row[1]: row[2] for row in _table(body, "Input")}
    assert world["model"] in sources and world["calibration"] in sources
    assert (tmp_path / "published" / card.DENSITY_FILE).read_bytes().startswith(b"\x89PNG")
    assert "](density.png)" in body


def test_a_public_card_names_no_internal_location_and_gives_the_hub_its_evaluation_results(world, tmp_path):
    """By default the card names no path or bucket URI (the lineage tables keep each one's last part); its header
    holds `model-index`: the published model's primary score per task, as the Hub's evaluation widget reads it."""
    from huggingface_hub import ModelCard

    text = _publish(world, tmp_path / "published")
    roots = {str(Path(world[k]).parent) for k in ("model", "pruned", "evaluated_full", "calibration")}
    assert not [root for root in roots if root in text], "an internal path is in the public card"
    meta, body = _split_card(text)
    shown = sorted(row[0] for row in _table(body, "Artifact"))
    behind = _lineage_contents([world[k] for k in ("pruned", "evaluated", "evaluated_full", "search_out", "report")])
    assert shown == sorted("…/" + Path(uri).name for uri in behind)
    primary = [r for r in records.read(world["evaluated"], records.MetricsRecord).to_json()["records"] if r["primary"]]
    (index,) = meta["model-index"]
    results = [(r["dataset"]["name"], r["metrics"][0]["type"], r["metrics"][0]["value"]) for r in index["results"]]
    assert results == [(r["task"], r["metric"], r["value"]) for r in primary]
    card_data = ModelCard(text).data
    assert [(e.dataset_name, e.metric_type, e.metric_value) for e in card_data.eval_results] == results
    assert "base_model_relation" not in meta  # pruning is none of the Hub's four relations
    assert "datasets" not in meta  # the tiny world's data are local files, not Hub datasets


def test_withheld_cuts_uris_and_paths_to_their_last_part_and_keeps_hub_names():
    assert card.withheld("s3://bucket/team/evoesap/prune/abc") == "…/abc"
    assert card.withheld("tasks=/home/me/tasks, x=1") == "tasks=…/tasks, x=1"
    assert card.withheld("allenai/OLMoE-1B-7B-0125-Instruct") == "allenai/OLMoE-1B-7B-0125-Instruct"
    assert card.withheld("file:///data/cal.jsonl") == "…/cal.jsonl"


def test_a_base_model_whose_config_contradicts_the_checkpoint_s_is_refused_in_one_line(world, tmp_path, monkeypatch):
    import huggingface_hub

    config = json.loads((Path(world["model"]) / "config.json").read_text())
    served = tmp_path / "hub-config.json"
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, **kw: str(served))
    served.write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    with pytest.raises(ConfigError, match=r"base_model 'org/other' contradicts the config .*hidden_size") as refused:
        run_publish(world["pruned"], [world["evaluated"]], PublishParams(base_model="org/other"), str(tmp_path / "a"))
    assert "\n" not in str(refused.value) and not (tmp_path / "a").exists()
    served.write_text(json.dumps(config))  # the base it was trained from: accepted, named on the card
    run_publish(world["pruned"], [world["evaluated"]], PublishParams(base_model="org/base", license="mit"), str(tmp_path / "b"))
    meta, _ = _split_card((tmp_path / "b" / "README.md").read_text())
    assert meta["base_model"] == "org/base" and meta["license"] == "mit"


def test_evaluation_table_puts_each_models_value_and_stderr_in_its_column():
    def metrics(value: float, stderr: float | None) -> list[records.TaskMetric]:
        return [records.TaskMetric("gsm8k", "math", "exact_match", "strict", value, stderr, samples=1319, primary=True)]

    table = card.evaluation_table(metrics(0.3125, 0.0125), metrics(0.5, 0.0138), digits=3)
    assert [c.text for c in table.rows[0]] == ["gsm8k", "exact_match", "0.500 ± 0.014", "0.312 ± 0.013", "-0.188", "1319"]
    alone = card.evaluation_table(metrics(0.25, None), (), digits=2)
    assert [c.text for c in alone.rows[0]][2:5] == ["–", "0.25", "–"]


def test_a_quantized_checkpoint_is_published_with_its_recipe_bytes_and_lineage_traced_to_artifacts(tiny_quantized, tmp_path):
    from huggingface_hub import ModelCard

    q = tiny_quantized
    evaluations = [q["evaluated_quantized"], q["evaluated"], q["evaluated_full"]]
    out = tmp_path / "published"
    run_publish(
        q["pruned"], evaluations, PublishParams(show_locations=True), str(out), search=q["search_out"], quantized=q["quantized"]
    )
    text = (out / "README.md").read_text()
    meta, body = _split_card(text)
    assert ModelCard(text).data.to_dict() == meta
    summary = records.read(q["quantized"], records.QuantizationRecord).to_json()
    assert {"compressed-tensors", summary["recipe"]} <= set(meta["tags"])
    assert f"quantized ({summary['recipe']})" in next(line for line in body.splitlines() if line.startswith("# "))

    # the released checkpoint is the quantize artifact's, byte for byte, beside the card and the density plot
    quantized_files = json.loads(Path(q["quantized"], "manifest.json").read_text())["files"]
    published = json.loads((out / "manifest.json").read_text())["files"]
    assert {k: v for k, v in published.items() if k in quantized_files} == quantized_files
    assert set(published) - set(quantized_files) == {"README.md", card.DENSITY_FILE}
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"

    # the evaluation table: full, pruned and quantized value ± stderr per task, each from its metrics.json
    full, pruned, quant = (
        records.read(q[k], records.MetricsRecord).to_json() for k in ("evaluated_full", "evaluated", "evaluated_quantized")
    )
    assert _header(body, "Task") == [
        "Task",
        "Metric",
        "Full",
        "Pruned",
        f"Pruned + {summary['recipe']}",
        "Δ (quantized − full)",
        "Samples",
    ]
    rows = _table(body, "Task")
    primary = [r for r in quant["records"] if r["primary"]]
    assert [row[:2] for row in rows] == [[r["task"], r["metric"]] for r in primary] and primary
    for row, rec in zip(rows, primary):
        same = [
            next(r for r in m["records"] if (r["task"], r["metric"], r["filter"]) == (rec["task"], rec["metric"], rec["filter"]))
            for m in (full, pruned)
        ]
        for cell, source in zip(row[2:5], [*same, rec]):
            value, stderr = (float(x) for x in cell.split("±"))
            assert abs(value - source["value"]) <= 5e-4 and abs(stderr - source["stderr"]) <= 5e-4
        assert abs(float(row[5]) - (rec["value"] - same[0]["value"])) <= 5e-4

    # the bytes before and after, and the saving, from quantization.json
    stored = {row[0]: row for row in _table(body, "Checkpoint")}
    before, after = summary["checkpoint_bytes_before"], summary["checkpoint_bytes_after"]
    assert int(stored["Pruned"][1].replace(",", "")) == before == (Path(q["pruned"]) / "model.safetensors").stat().st_size
    assert int(stored[f"Pruned + {summary['recipe']}"][1].replace(",", "")) == after
    assert stored[f"Pruned + {summary['recipe']}"][2] == f"{(before - after) / before:.1%}"
    assert f"scheme {summary['scheme']}" in body and f"llmcompressor {summary['versions']['llmcompressor']}" in body

    # lineage: the quantize manifest among every artifact behind the card, walked by hand
    shown = {row[0]: row[3] for row in _table(body, "Artifact")}
    assert shown == _lineage_contents([q["quantized"], q["pruned"], *evaluations, q["search_out"]])
    assert shown[q["quantized"]] == artifacts.artifact_identity(q["quantized"])["content_sha256"]


def _header(body: str, header_start: str) -> list[str]:
    line = next(line for line in body.splitlines() if line.startswith(f"| {header_start}"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_a_quantized_checkpoint_of_another_model_or_without_its_evaluation_is_refused_before_any_work(
    tiny_quantized, world, tmp_path
):
    q = tiny_quantized
    with pytest.raises(
        ConfigError, match=r"^--quantized .* quantized .*, not --pruned .*licensed_pruned: give the quantize artifact"
    ):
        run_publish(
            world["licensed_pruned"],
            [world["licensed_evaluated"]],
            PublishParams(),
            str(tmp_path / "a"),
            quantized=q["quantized"],
        )
    with pytest.raises(ConfigError, match=r"^no evaluation of the quantized model .*: run `evoesap evaluate --model "):
        run_publish(q["pruned"], [q["evaluated"]], PublishParams(), str(tmp_path / "b"), quantized=q["quantized"])
    assert not list(tmp_path.iterdir())


def _serve_config(monkeypatch, tmp_path: Path, model: str, **changes: Any) -> None:
    """The Hub, faked: every config.json it serves is `model`'s, with `changes`."""
    import huggingface_hub

    served = tmp_path / "hub-config.json"
    served.write_text(json.dumps({**json.loads((Path(model) / "config.json").read_text()), **changes}))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, **kw: str(served))


def _hub_fails(monkeypatch, exc: Exception) -> None:
    import huggingface_hub

    def fail(repo: str, name: str, **kw: Any) -> str:
        raise exc

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)


def _not_found() -> RepositoryNotFoundError:
    reply = requests.Response()
    reply.status_code, reply.url = 404, "https://huggingface.co/org/base/resolve/main/config.json"
    return RepositoryNotFoundError("404 Client Error: Repository Not Found", response=reply)


@pytest.mark.parametrize(
    "answer",
    [
        OSError("[Errno 101] Network is unreachable"),  # an air-gapped cluster: the Hub cannot be asked
        _not_found(),
    ],
    ids=["hub-unreachable", "no-such-model"],
)
def test_an_unverifiable_base_model_is_refused_unless_published_as_unverified(world, tmp_path, monkeypatch, answer):
    _hub_fails(monkeypatch, answer)
    with pytest.raises(ConfigError, match=r"^base_model 'org/base' could not be verified .*--base-model-unverified") as refused:
        run_publish(
            world["pruned"], [world["evaluated"]], PublishParams(base_model="org/base", license="mit"), str(tmp_path / "a")
        )
    assert "\n" not in str(refused.value) and not (tmp_path / "a").exists()

    params = PublishParams(base_model="org/base", license="mit", base_model_unverified=True)
    run_publish(world["pruned"], [world["evaluated"]], params, str(tmp_path / "b"))
    meta, body = _split_card((tmp_path / "b" / "README.md").read_text())
    assert meta["base_model"] == "org/base" and "**The base model was not verified.** `org/base`" in body


def test_a_verified_base_model_s_card_does_not_say_unverified_and_the_flag_needs_a_base_model(world, tmp_path, monkeypatch):
    _serve_config(monkeypatch, tmp_path, world["model"])
    params = PublishParams(base_model="org/base", license="mit", base_model_unverified=True)
    run_publish(world["pruned"], [world["evaluated"]], params, str(tmp_path / "a"))
    assert "not verified" not in (tmp_path / "a" / "README.md").read_text()
    with pytest.raises(ConfigError, match=r"^base_model_unverified without base_model: "):
        PublishParams(base_model_unverified=True)


def test_license_and_base_model_are_carried_and_a_contradiction_is_refused(world, tmp_path, monkeypatch):
    _serve_config(monkeypatch, tmp_path, world["model"])
    params = PublishParams(base_model=BASE)
    run_publish(world["licensed_pruned"], [world["licensed_evaluated"]], params, str(tmp_path / "a"))
    meta, body = _split_card((tmp_path / "a" / "README.md").read_text())
    assert meta["license"] == "apache-2.0" and meta["base_model"] == BASE
    assert "the full model was not evaluated" in body
    with pytest.raises(ConfigError, match="contradicts the base model's card"):
        run_publish(world["licensed_pruned"], [world["licensed_evaluated"]], PublishParams(license="mit"), str(tmp_path / "b"))
    assert not (tmp_path / "b").exists()


HOSTILE = (
    'x"\n<script>alert(1)</script>: [y]',
    "---\nlicense: evil\n---",
    "- !!python/object/apply:os.system ['id']",
    "{{ 7*7 }} | a | <img src=x onerror=alert(1)>",
)


def test_hostile_task_names_and_license_keys_keep_the_header_exact_and_the_body_literal(world, tmp_path, monkeypatch):
    """Task names and metrics (lm-eval's, from the evaluation), the license keys of the base model's card and the
    checkpoint's dtype are text from elsewhere: the YAML header parses to exactly the mapping meant, and the Markdown
    body, rendered as the Hub would (raw HTML allowed), shows each literally and runs no markup."""
    import html

    from markdown_it import MarkdownIt

    from evoesap.stages import publish

    license = {"license": "other", "license_name": HOSTILE[0], "license_link": HOSTILE[1]}
    names = {}  # (task, metric) in the evaluation -> the hostile (task, metric) shown

    def hostile(task: str, metric: str) -> tuple[str, str]:
        return names.setdefault((task, metric), (HOSTILE[len(names) % len(HOSTILE)], HOSTILE[(len(names) + 1) % len(HOSTILE)]))

    def renamed(doc: records.MetricsRecord | None) -> records.MetricsRecord | None:
        if doc is None:
            return None
        rows = []
        for row in doc.records:
            task, metric = hostile(row.task, row.metric)
            rows.append(dataclasses.replace(row, task=task, metric=metric))
        return dataclasses.replace(doc, records=tuple(rows))

    real = publish._evidence

    def evidence(*args: Any) -> card.Evidence:
        found = real(*args)
        return dataclasses.replace(
            found,
            pruned_eval=renamed(found.pruned_eval),
            full_eval=renamed(found.full_eval),
            license=license,
            config={**found.config, "torch_dtype": HOSTILE[0], "dtype": HOSTILE[0]},
        )

    monkeypatch.setattr(publish, "_evidence", evidence)
    text = _publish(world, tmp_path / "published")
    meta, body = _split_card(text)

    pruning = records.read(world["pruned"], records.PruningRecord).to_json()
    evaluated = records.read(world["evaluated"], records.MetricsRecord)
    primary = [(*names[(r.task, r.metric)], r.value) for r in evaluated.records if r.primary]
    assert len(primary) >= 1
    assert meta == {
        "license": "other",
        "license_name": HOSTILE[0],
        "license_link": HOSTILE[1],
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["evoesap", "expert-pruning", "mixture-of-experts", evaluated.experts.family, pruning["criterion"]],
        "model-index": [
            {
                "name": f"the base model, {pruning['sparsity']:.0%} of routed experts pruned "
                f"({pruning['criterion']}, {pruning['method']})",
                "results": [
                    {
                        "task": {"type": "text-generation"},
                        "dataset": {"name": task, "type": task},
                        "metrics": [{"type": metric, "value": value}],
                    }
                    for task, metric, value in primary
                ],
            }
        ],
    }
    assert not re.search(r"(?<!\\)<(script|img)", body), "markup from a task name is in the card unescaped"
    page = MarkdownIt("commonmark", {"html": True}).enable("table").render(body)
    assert "<script" not in page and "<img src=x" not in page  # the density plot is the card's one image
    cells = [html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", page, re.S)]
    for task, metric, _ in primary:
        assert " ".join(task.split()) in cells and " ".join(metric.split()) in cells
    assert f"stored in {' '.join(HOSTILE[0].split())}, as pruned" in html.unescape(re.sub(r"<[^>]+>", "", page))


@pytest.mark.parametrize(
    "license",
    ["mit\n<script>alert(1)</script>", "apache 2.0", "mit: [x]", "", "-mit", "a" * 65, "mit\n"],
)
def test_a_license_that_is_not_an_identifier_is_refused_in_one_line_before_any_work(world, tmp_path, capsys, license):
    out = tmp_path / "published"
    options = ["--evaluations", world["evaluated"], "--out", str(out), "--license", license]
    assert main(["publish", "--pruned", world["pruned"], *options]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a license identifier" in err and repr(license) in err, err
    assert not out.exists()


@pytest.mark.parametrize("license", ["apache-2.0", "MIT", "llama3.1", "cc-by-nc-sa-4.0", "GPL-3.0-or-later", "other"])
def test_hub_and_spdx_license_ids_are_accepted(license):
    assert PublishParams(license=license).license == license


def test_a_base_card_naming_a_license_that_is_not_an_identifier_is_refused(world, monkeypatch, tmp_path):
    from evoesap.stages import publish

    monkeypatch.setattr(publish, "_base_card", lambda entry: {"license": "mit\n<script>alert(1)</script>"})
    with pytest.raises(ConfigError, match=r"^the base model's card names license 'mit\\n<script>.*correct its README"):
        _publish(world, tmp_path / "published")
    assert not (tmp_path / "published").exists()


def test_a_public_card_keeps_values_holding_a_slash_that_name_no_location(world, tmp_path):
    text = _publish(world, tmp_path / "published")
    _, body = _split_card(text)
    parameters = dict(_table(body, "Stage"))
    assert "think_end_token=</think>" in parameters["evaluate"].split(", ")
    assert card.withheld("think_end_token=</think>, stop=<|im_end|>, a=b/c, x=and/or") == (
        "think_end_token=</think>, stop=<|im_end|>, a=b/c, x=and/or"
    )
    assert card.withheld('tasks=["/home/me/tasks"], cache=(/data/x), at /srv/y') == 'tasks=["…/tasks"], cache=(…/x), at …/y'


def test_a_chain_run_on_relative_paths_has_every_lineage_row_readable_from_another_directory(tmp_path, monkeypatch):
    """Stages given relative paths record where their inputs are (absolute), so a report and a card made from another
    working directory read every artifact and source behind them; the reuse key holds content only, so the same
    inputs named by absolute paths reuse the artifacts."""
    from tiny_artifacts import CALIBRATE
    from tiny_world import make_tiny_inputs

    from evoesap.params import keyed
    from evoesap.stages.calibrate import run_calibrate
    from evoesap.stages.prune import PruneParams
    from evoesap.stages.report import ReportParams, run_report
    from evoesap.store import lineage

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    make_tiny_inputs(work)
    monkeypatch.chdir(work)
    run_calibrate("model", "./calibration.jsonl", CALIBRATE, "scores")
    prune = PruneParams(criterion="reap", sparsity=0.25)
    run_prune("model", "scores/", prune, "pruned")
    run_evaluate("pruned", evaluate_params("tasks", method="uniform", criterion="reap", sparsity=0.25), "evaluated")

    manifest = artifacts.read_manifest("scores")
    assert {k: e["uri"] for k, e in manifest.inputs.items()} == {
        "model": str(work / "model"),
        "data": str(work / "calibration.jsonl"),
    }
    assert artifacts.read_manifest("pruned").inputs["scores"]["uri"] == str(work / "scores")
    absolute = {"model": str(work / "model"), "data": str(work / "calibration.jsonl")}
    assert artifacts.cached(str(work / "scores"), "calibrate", keyed(CALIBRATE), absolute) is not None  # reused

    monkeypatch.chdir(elsewhere)
    report, published = elsewhere / "report", elsewhere / "published"
    run_report([str(work / "evaluated")], ReportParams(), str(report))
    run_publish(str(work / "pruned"), [str(work / "evaluated")], PublishParams(show_locations=True), str(published))

    walked = lineage.walk({"pruned": str(work / "pruned"), "evaluations.0": str(work / "evaluated")}, "publish")
    assert sorted(Path(n.uri).name for n in walked.nodes) == ["evaluated", "pruned", "scores"]
    assert all(n.manifest is not None for n in walked.nodes)
    assert sorted(s.uri for s in walked.sources) == sorted({str(work / "model"), str(work / "calibration.jsonl")})
    assert all(Path(s.uri).exists() for s in walked.sources)
    meta, body = _split_card((published / "README.md").read_text())
    artifact_rows = _table(body, "Artifact")
    assert sorted(Path(row[0]).name for row in artifact_rows) == ["evaluated", "pruned", "scores"]
    assert not [row for row in artifact_rows if "unreadable" in row], artifact_rows
    page = (report / "report.md").read_text()
    rows = _table(page.split("### Artifacts", 1)[1], "Artifact")
    assert sorted(Path(row[0]).name for row in rows) == ["evaluated", "pruned", "scores"]
    assert not [row for row in rows if "unreadable" in row], rows


@pytest.mark.parametrize("store", ["local", "memory"])
def test_a_push_to_an_fsspec_target_round_trips_byte_identical_files(world, tmp_path, store):
    out = tmp_path / "published"
    to = str(tmp_path / "release" / "olmoe-pruned") if store == "local" else f"memory://release-{tmp_path.name}/olmoe-pruned"
    _publish(world, out, PublishParams(to=to))
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    fs, root = artifacts.split(to)
    assert files == sorted(p[len(root.rstrip("/")) + 1 :] for p in fs.find(root))  # no publishing.json left
    assert all((out / f).read_bytes() == artifacts.read_bytes(artifacts.join(to, f)) for f in files)
    manifest = artifacts.verify(to, "publish")  # a finished artifact there, every sha256 checked
    prune_files = artifacts.read_manifest(world["pruned"]).files
    assert {f: manifest.files[f] for f in prune_files} == prune_files  # the checkpoint itself, untouched
    assert {"README.md", "density.png", "report/report.md"} <= set(manifest.files)


# ---------------------------------------------------------------------------------------------- the Hub


class HubRecorder(BaseHTTPRequestHandler):
    """The few Hub endpoints huggingface_hub's create_repo / list_repo_files / create_commit call, recording each
    (method, path, headers, body); repositories live in `repos` (name -> {path: bytes})."""

    requests: list[tuple[str, str, dict[str, str], Any]] = []
    repos: dict[str, dict[str, bytes]] = {}
    fail_commit = False

    def _reply(self, body: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _repo(self) -> str:
        return "/".join(self.path.split("?")[0].split("/")[3:5])

    def do_GET(self):  # noqa: N802
        self.requests.append(("GET", self.path.split("?")[0], dict(self.headers), None))
        repo = self._repo()
        if repo not in self.repos:
            self._reply({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})
            return
        self._reply([{"type": "file", "path": p, "size": len(b), "oid": "0" * 40} for p, b in self.repos[repo].items()])

    def do_POST(self):  # noqa: N802
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        if path.endswith("/commit/main"):
            body: Any = [json.loads(line) for line in raw.decode().splitlines() if line]
        else:
            body = json.loads(raw or b"{}")
        self.requests.append(("POST", path, dict(self.headers), body))
        if path == "/api/repos/create":
            repo = f"{body['organization']}/{body['name']}"
            self.repos.setdefault(repo, {".gitattributes": b"*.safetensors filter=lfs\n"})
            self._reply({"url": f"http://{self.headers['Host']}/{repo}"})
        elif path == "/api/validate-yaml":
            self._reply({})
        elif "/preupload/" in path:
            self._reply({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in body["files"]]})
        elif self.fail_commit:
            self._reply({"error": "You don't have the rights to push to this repository"}, 403)
        else:
            files = {op["value"]["path"]: base64.b64decode(op["value"]["content"]) for op in body if op["key"] == "file"}
            self.repos[self._repo()].update(files)
            self._reply(
                {
                    "commitUrl": f"http://{self.headers['Host']}/{self._repo()}/commit/{'a' * 40}",
                    "commitOid": "a" * 40,
                    "pullRequestUrl": None,
                }
            )

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(monkeypatch) -> Iterator[str]:
    HubRecorder.requests, HubRecorder.repos, HubRecorder.fail_commit = [], {}, False
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubRecorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("EVOESAP_TEST_HUB_TOKEN", TOKEN)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def _cli(world: dict[str, str], out: Path, *options: str) -> int:
    return main(
        [
            "publish",
            "--pruned",
            world["pruned"],
            "--evaluations",
            world["evaluated"],
            "--evaluations",
            world["evaluated_full"],
            "--search",
            world["search_out"],
            "--out",
            str(out),
            *options,
        ]
    )


def test_a_hub_push_makes_one_commit_of_every_file_and_the_token_is_nowhere(world, hub, tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "published"
    assert _cli(world, out, "--repo", "team/olmoe-pruned", "--endpoint", hub, "--token-env", "EVOESAP_TEST_HUB_TOKEN") == 0
    calls = [(method, path) for method, path, _, _ in HubRecorder.requests]
    assert calls == [
        ("GET", "/api/models/team/olmoe-pruned/tree/main"),  # checked before any work: not there yet
        ("POST", "/api/repos/create"),
        ("POST", "/api/validate-yaml"),  # the Hub checks the card's metadata before anything uploads
        ("POST", "/api/models/team/olmoe-pruned/preupload/main"),
        ("POST", "/api/models/team/olmoe-pruned/commit/main"),
    ]
    assert all(headers.get("authorization") == f"Bearer {TOKEN}" for _, _, headers, _ in HubRecorder.requests)
    create = HubRecorder.requests[1][3]
    assert (create["organization"], create["name"], create["visibility"]) == ("team", "olmoe-pruned", "private")
    assert HubRecorder.requests[2][3]["content"] == (out / "README.md").read_text()
    published = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    pushed = HubRecorder.repos["team/olmoe-pruned"]
    assert {k: v for k, v in pushed.items() if k != ".gitattributes"} == published  # byte for byte, manifest too
    every_byte = b"".join(published.values()) + capsys.readouterr().out.encode() + caplog.text.encode()
    assert TOKEN.encode() not in every_byte
    assert json.loads(published["manifest.json"])["params"]["token_env"] == "EVOESAP_TEST_HUB_TOKEN"


def test_a_failed_hub_push_publishes_nothing_and_says_so_in_one_line(world, hub, tmp_path, capsys):
    HubRecorder.fail_commit = True
    out = tmp_path / "published"
    assert _cli(world, out, "--repo", "team/denied", "--endpoint", hub, "--token-env", "EVOESAP_TEST_HUB_TOKEN") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:")
    assert "team/denied" in err and "no commit was made" in err and TOKEN not in err
    assert not out.exists() and not list(tmp_path.glob(".published.*"))
    assert set(HubRecorder.repos["team/denied"]) == {".gitattributes"}


def test_a_hub_repository_holding_other_files_is_refused_before_any_work(world, hub, tmp_path, capsys):
    HubRecorder.repos["team/old"] = {".gitattributes": b"", "model-00001-of-00002.safetensors": b"stale"}
    out = tmp_path / "published"
    assert _cli(world, out, "--repo", "team/old", "--endpoint", hub, "--token-env", "EVOESAP_TEST_HUB_TOKEN") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model-00001-of-00002.safetensors" in err
    assert [m for m, *_ in HubRecorder.requests] == ["GET"] and not out.exists()


def test_a_hub_push_without_a_token_is_refused_before_any_work(world, hub, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("EVOESAP_TEST_HUB_TOKEN")
    out = tmp_path / "published"
    assert _cli(world, out, "--repo", "team/x", "--endpoint", hub, "--token-env", "EVOESAP_TEST_HUB_TOKEN") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "EVOESAP_TEST_HUB_TOKEN" in err
    assert HubRecorder.requests == [] and not out.exists()


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing prune", "does not exist"),
        ("evaluation of another model", "neither the pruned model"),
        ("no evaluation of the pruned model", "no evaluation of the pruned model"),
        ("a prune artifact as evaluation", "is a 'prune' artifact, not 'evaluate'"),
        ("a report without the pruned model", "does not cover the pruned model's evaluation"),
        ("to is out", "give another place to push to"),
    ],
)
def test_bad_inputs_are_refused_in_one_line_before_any_work(world, tmp_path, capsys, case, message):
    out = tmp_path / "published"
    pruned, evaluations, extra = world["pruned"], [world["evaluated"]], []
    if case == "missing prune":
        pruned = str(tmp_path / "no-such-prune")
    elif case == "evaluation of another model":
        evaluations = [world["evaluated"], world["licensed_evaluated"]]
    elif case == "no evaluation of the pruned model":
        evaluations = [world["evaluated_full"]]
    elif case == "a prune artifact as evaluation":
        evaluations = [world["pruned"]]
    elif case == "a report without the pruned model":
        pruned, evaluations, extra = world["licensed_pruned"], [world["licensed_evaluated"]], ["--report", world["report"]]
    else:
        extra = ["--to", str(out)]
    options = [o for e in evaluations for o in ("--evaluations", e)]
    assert main(["publish", "--pruned", pruned, *options, "--out", str(out), *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and message in err, err
    assert not out.exists()


def test_the_pipeline_publishes_each_searched_model_only_when_switched_on(tmp_path):
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.dag import build_pipeline
    from kfp import compiler

    base = {"model": "m", "calibration_data": "c.jsonl", "search_data": "s.jsonl"}
    specs = {}
    for switch in (False, True):
        path = tmp_path / f"{switch}.yaml"
        compiler.Compiler().compile(build_pipeline(load_config({**base, "publish_models": switch})), str(path))
        specs[switch] = yaml.safe_load(path.read_text())
    assert "comp-publish" not in specs[False]["components"]
    loop = next(c for c in specs[True]["components"].values() if "publish" in c.get("dag", {}).get("tasks", {}))
    wired = loop["dag"]["tasks"]["publish"]["inputs"]["artifacts"]
    assert {name: (a.get("taskOutputArtifact") or a.get("componentInputArtifact")) for name, a in wired.items()} == {
        "pruned": {"outputArtifactKey": "pruned", "producerTask": "prune"},
        "evaluation": {"outputArtifactKey": "evaluation", "producerTask": "evaluate-2"},
        "search": {"outputArtifactKey": "allocation", "producerTask": "search"},
        "full_evaluation": "pipelinechannel--evaluate-evaluation",
    }
    with pytest.raises(ConfigError, match="publish.repo is one place"):
        load_config({**base, "publish_models": True, "sparsities": [0.25, 0.5], "publish": {"repo": "org/name"}})


@pytest.fixture
def fresh_hub_client(monkeypatch):
    """huggingface_hub's client factory restored after a test that bound it to a hostile endpoint."""
    import huggingface_hub
    from huggingface_hub.utils import _http

    monkeypatch.setenv("EVOESAP_TEST_HUB_TOKEN", TOKEN)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield
    huggingface_hub.set_client_factory(_http.default_client_factory)


def test_what_a_hub_echoes_back_is_scrubbed_from_the_publish_error_line(world, tmp_path, capsys, fresh_hub_client):
    """The line ended with the server's echo of `Authorization: Basic ...` (user:password in base64)."""
    from recording_http import EchoHandler, serving

    class Refusing(EchoHandler):
        refusal = 400

    out = tmp_path / "published"
    with serving(Refusing) as url:
        assert _cli(world, out, "--repo", "team/x", "--endpoint", url, "--token-env", "EVOESAP_TEST_HUB_TOKEN") == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: reading the Hub repository team/x failed") and "request refused" in line, line
    assert "dXNlcjpodW50ZXIy" not in line and "hunter2" not in line and TOKEN not in line
    assert "Authorization: ***" in line and not out.exists()


def test_publish_to_a_hub_dripping_one_byte_at_a_time_ends_at_the_deadline(world, tmp_path, capsys, fresh_hub_client,
                                                                           monkeypatch):  # fmt: skip
    """`publish --repo` against an endpoint sending one byte a second never ended (a socket timeout bounds one read)."""
    import time

    from recording_http import dripping

    monkeypatch.setenv("EVOESAP_HUB_DEADLINE_S", "0.5")
    out = tmp_path / "published"
    with dripping() as url:
        start = time.monotonic()
        assert _cli(world, out, "--repo", "team/x", "--endpoint", url, "--token-env", "EVOESAP_TEST_HUB_TOKEN") == 1
        elapsed = time.monotonic() - start
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert elapsed < 10, elapsed
    assert line == (
        f"error: reading the Hub repository team/x at {url} did not finish within 0.5 s (the server is stalled or "
        "too slow): check it, or set EVOESAP_HUB_DEADLINE_S to allow longer"
    )
    assert not out.exists()


def test_a_push_to_a_dripping_hub_stops_at_its_deadline_and_sends_nothing_after(tmp_path, fresh_hub_client, monkeypatch):
    import time

    from recording_http import dripping

    from evoesap.errors import ArtifactError
    from evoesap.release import hub

    monkeypatch.setenv("EVOESAP_HUB_DEADLINE_S", "0.5")
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / "config.json").write_text("{}")
    with dripping() as url:
        start = time.monotonic()
        with pytest.raises(ArtifactError) as raised:
            hub.push(tmp_path / "staging", "team/x", endpoint=url, secret=TOKEN, private=True, message="m")
        elapsed = time.monotonic() - start
    line = str(raised.value)
    assert 0.5 <= elapsed < 3, elapsed
    assert line.startswith(f"pushing to the Hub repository team/x at {url} did not finish within 0.5") and TOKEN not in line
    assert "EVOESAP_HUB_DEADLINE_S" in line and "re-run `evoesap publish`" in line
