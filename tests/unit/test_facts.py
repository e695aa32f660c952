"""What an artifact says about itself for KFP's metadata: its own numbers, small files only, one-file HTML."""

import base64
import json
import re

from evoesap.records import facts
from evoesap.store import artifacts


def _artifact(path, stage, files):
    with artifacts.stage_output(str(path), stage, {}, {}) as staging:
        for name, data in files.items():
            (staging / name).write_bytes(data)
    return str(path)


def test_only_files_up_to_the_limit_are_exported_and_the_manifest_always(tmp_path):
    uri = _artifact(tmp_path / "art", "prune", {"config.json": b"{}", "model.safetensors": b"w" * 5000})
    copied = facts.export_small_files(uri, tmp_path / "view", max_bytes=1000)
    assert sorted(copied) == ["config.json", "manifest.json"]
    assert not (tmp_path / "view" / "model.safetensors").exists()
    assert (tmp_path / "view" / "manifest.json").read_bytes() == (tmp_path / "art" / "manifest.json").read_bytes()


def test_prune_facts_are_the_numbers_its_summary_records(tmp_path):
    summary = {"method": "searched", "criterion": "reap", "sparsity": 0.5, "removal_counts": [2, 1], "num_experts": [2, 3],
               "pruned": {}, "parameter_bytes_full": 100, "parameter_bytes_pruned": 60}  # fmt: skip
    uri = _artifact(tmp_path / "art", "prune", {"pruning.json": json.dumps(summary).encode()})
    got = facts.facts(uri)
    assert got["expert_counts"] == [2, 3] and got["parameter_bytes"] == 60 and got["method"] == "searched"
    assert got["uri"] == uri and got["manifest_sha256"] == artifacts.manifest_sha256(uri)


def test_report_html_is_one_file_with_its_plots_inlined_and_a_changed_page_is_refused(tiny_artifacts, tmp_path):
    """The report stage embeds its plots, so the KFP HTML view gets the verified page itself, every image inline."""
    import shutil

    import pytest

    from evoesap.errors import ArtifactError

    html = facts.standalone_html(tiny_artifacts["report"])
    sources = re.findall(r'<img src="([^"]+)"', html)
    assert sources and all(src.startswith("data:image/png;base64,") for src in sources)
    assert base64.b64decode(sources[0].split(",", 1)[1]).startswith(b"\x89PNG")
    copy = tmp_path / "report"
    shutil.copytree(tiny_artifacts["report"], copy)
    (copy / "report.html").write_text("<html>changed</html>")
    with pytest.raises(ArtifactError, match="report.html does not match the sha256"):
        facts.standalone_html(str(copy))


def test_each_stage_s_facts_come_from_its_registry_entry(tmp_path, monkeypatch):
    """The headline numbers are the registry entry's `facts`; a stage without one gets the common keys only."""
    import dataclasses

    from evoesap import registry

    assert {s.name for s in registry.STAGES if s.facts} == {"search", "prune", "evaluate", "quantize", "gate"}
    assert all(callable(s.facts_function()) for s in registry.STAGES if s.facts)
    uri = _artifact(tmp_path / "art", "report", {"report.md": b"# r"})
    common = {"uri", "stage", "manifest_sha256", "inputs", "evoesap_version"}
    assert set(facts.facts(uri)) == common
    marked = tuple(
        dataclasses.replace(s, facts="tests.unit.test_facts:_marker") if s.name == "report" else s for s in registry.STAGES
    )
    monkeypatch.setattr(registry, "STAGES", marked)
    assert facts.facts(uri)["marker"] == uri


def _marker(uri: str) -> dict:
    return {"marker": uri}
