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

    assert {s.name for s in registry.STAGES if s.facts} == {"search", "prune", "evaluate", "quantize", "gate", "publish"}
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


def _search(path, *, searched, uniform, heldout, fallback=False, metric="esap"):
    doc = {"criterion": "reap", "sparsity": 0.25, "removal_counts": uniform if fallback else searched, "pruned": {},
           "metric": metric, "searched": {"removal_counts": searched, "fitness": 0.91},
           "uniform": {"removal_counts": uniform, "fitness": 0.88}, "fallback_applied": fallback, "heldout": heldout}  # fmt: skip
    return _artifact(path, "search", {"allocation.json": json.dumps(doc).encode()})


def test_search_headline_says_searched_against_uniform_on_held_out_samples_and_where_the_details_are(tmp_path):
    check = {"samples": 16, "searched": 0.9, "uniform": 0.85, "difference": 0.05, "stderr": 0.01, "beats_uniform": True}
    uri = _search(tmp_path / "s", searched=[2, 0], uniform=[1, 1], heldout=check)
    line = facts.search_headline(uri)
    assert "\n" not in line
    assert line == (
        "search: searched [2, 0] vs uniform [1, 1], held-out esap 0.90000 vs 0.85000 (+5.0e-02, 5.0 standard errors, "
        f"16 samples): beats uniform; details: {uri}/allocation.json"
    )


def test_search_headline_says_when_the_search_kept_uniform_lost_or_fell_back(tmp_path):
    tie = {"samples": 4, "searched": 0.9, "uniform": 0.9, "difference": 0.0, "stderr": 0.0, "beats_uniform": False}
    kept = facts.search_headline(_search(tmp_path / "a", searched=[1, 1], uniform=[1, 1], heldout=tie))
    assert kept.startswith("search: searched = uniform [1, 1], held-out esap 0.90000 vs 0.90000 (+0.0e+00, 4 samples)")
    assert "does not beat uniform" in kept
    worse = {"samples": 8, "searched": 0.8, "uniform": 0.9, "difference": -0.1, "stderr": 0.02, "beats_uniform": False}
    fell = facts.search_headline(_search(tmp_path / "b", searched=[2, 0], uniform=[1, 1], heldout=worse, fallback=True))
    assert "(-1.0e-01, -5.0 standard errors, 8 samples): does not beat uniform" in fell and "fell back to uniform" in fell


def test_search_headline_without_held_out_samples_compares_on_the_search_set(tmp_path):
    empty = {"samples": 0, "searched": None, "uniform": None, "difference": None, "stderr": None, "beats_uniform": False}
    line = facts.search_headline(_search(tmp_path / "s", searched=[2, 0], uniform=[1, 1], heldout=empty, metric="kl"))
    assert "search-set kl 0.91000 vs 0.88000 (no held-out samples): held-out check not run" in line
