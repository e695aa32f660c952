"""Every stage's artifact from a tiny random OLMoE (tiny_world), for the fault and bad-input catalogue."""

from pathlib import Path

from tiny_world import make_tiny_inputs

from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
from evoesap.stages.calibrate import CalibrateParams, run_calibrate
from evoesap.stages.evaluate import EvaluateParams, run_evaluate
from evoesap.stages.prune import PruneParams, run_prune
from evoesap.stages.report import ReportParams, run_report
from evoesap.stages.search import SearchParams, run_search

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


def quantized_build(built: dict[str, str], root: Path) -> dict[str, str]:
    """`built` (from `build`) plus: evaluated_full, quantized (fp8-dynamic: per channel, any width), evaluated_quantized
    and report_quantized (the full, pruned and quantized evaluations)."""
    import os

    from test_quantize import quantize_python

    from evoesap.stages.quantize import QuantizeParams, run_quantize

    out = {**built, **{name: str(root / name) for name in ("evaluated_full", "quantized", "evaluated_quantized")}}
    out["report_quantized"] = str(root / "report_quantized")
    run_evaluate(built["model"], evaluate_params(built["tasks"], method="full"), out["evaluated_full"])
    before = os.environ.get("EVOESAP_QUANTIZE_PYTHON")
    os.environ["EVOESAP_QUANTIZE_PYTHON"] = quantize_python()
    try:
        run_quantize(built["pruned"], QuantizeParams(recipe="fp8-dynamic", device="cpu"), out["quantized"])
    finally:
        os.environ.pop("EVOESAP_QUANTIZE_PYTHON") if before is None else os.environ.update(EVOESAP_QUANTIZE_PYTHON=before)
    run_evaluate(out["quantized"], evaluate_params(built["tasks"], method="searched"), out["evaluated_quantized"])
    runs = [out["evaluated_full"], built["evaluated"], out["evaluated_quantized"]]
    run_report(runs, ReportParams(), out["report_quantized"], searches=[built["search_out"]])
    return out
