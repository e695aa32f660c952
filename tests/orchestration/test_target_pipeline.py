"""A quality target in a real local run (kfp.local): the finder task bisects the grid before the fan-out, and the
point it hands on prunes, evaluates and reports as a given sparsity would, reusing the chosen probe's search."""

import pytest
from evoesap.pipeline.config import load_config
from evoesap.pipeline.run import run_local
from test_pipeline_run import SEARCH, _artifacts, _config
from tiny_world import make_tiny_inputs

from evoesap import records
from evoesap.store import artifacts

pytestmark = pytest.mark.slow


def test_a_quality_target_runs_in_the_dag_and_its_point_reuses_the_chosen_probe(tmp_path):
    files = make_tiny_inputs(tmp_path / "tiny")  # 4 MoE layers of 8 experts, top-2
    storage = tmp_path / "run" / "artifacts"
    settings = _config(files, storage, target={"heldout_esap": 0.5}, search={**SEARCH, "granularity": 4})
    del settings["sparsities"]  # the target chooses it
    outputs = run_local(load_config(settings), log_path=tmp_path / "run.log")

    (target,) = _artifacts(storage, "target")
    record = records.read(str(target), records.TargetRecord)
    assert record.chosen is not None and len(record.probes) <= record.max_probes
    (pruned,) = outputs["pruned_models"]
    assert pruned.metadata["sparsity"] == record.chosen and pruned.metadata["criterion"] == "reap"
    # the point's search is the chosen probe, found finished: no search beyond the probes
    searches = _artifacts(storage, "search")
    assert len(searches) == len(record.probes)
    allocation = artifacts.read_manifest(pruned.metadata["uri"], "prune").inputs["allocation"]["uri"]
    assert allocation.rstrip("/").rsplit("/", 1)[-1] == record.chosen_search.rstrip("/").rsplit("/", 1)[-1]
