"""Every stage's artifact from a tiny random OLMoE (tiny_world), for the fault and bad-input catalogue."""

from pathlib import Path

from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
from evoesap.stages.calibrate import CalibrateParams, run_calibrate
from evoesap.stages.evaluate import EvaluateParams, run_evaluate
from evoesap.stages.prune import PruneParams, run_prune
from evoesap.stages.report import ReportParams, run_report
from evoesap.stages.search import SearchParams, run_search
from tiny_world import make_tiny_inputs

CALIBRATE = CalibrateParams(samples=8, max_length=128)
CACHE = CacheLogitsParams(samples=6, max_length=128, dtype="float32")
SEARCH = SearchParams(criterion="reap", sparsity=0.5, population=4, elites=1, generations=1, batch_size=8)
PRUNE = PruneParams(criterion="reap", sparsity=0.5)


def evaluate_params(tasks: str, **labels) -> EvaluateParams:
    return EvaluateParams(tasks=(tasks,), limit=2, batch_size=2, device="cpu", max_length=128, **labels)


def build(root: Path) -> dict[str, str]:
    """Input files plus one artifact per stage under `root`; keys: model, calibration, search, heldout, tasks,
    scores, cache, search_out, pruned, evaluated, report."""
    files = make_tiny_inputs(root)
    out = {**files, **{name: str(root / name) for name in ("scores", "cache", "search_out", "pruned", "evaluated", "report")}}
    run_calibrate(files["model"], files["calibration"], CALIBRATE, out["scores"])
    run_cache_logits(files["model"], files["search"], CACHE, out["cache"])
    run_search(files["model"], out["scores"], out["cache"], SEARCH, out["search_out"])
    run_prune(files["model"], out["scores"], PRUNE, out["pruned"], allocation=out["search_out"])
    run_evaluate(
        out["pruned"], evaluate_params(files["tasks"], method="searched"), out["evaluated"], allocation=out["search_out"]
    )
    run_report([out["evaluated"]], ReportParams(), out["report"], searches=[out["search_out"]])
    return out
