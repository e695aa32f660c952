"""Demo-world figures in three sections (4, 5 and 6, as `--sections` names them), printed as markdown with the
command that made them.

On the trained demo OLMoE (4 MoE layers x 16 experts, top-2; CPU):

- Section 4: expert scores from the code and from the math calibration split; per criterion, the mean
  per-layer Spearman rank correlation between the two, beside a same-domain control (code calibration
  against other code samples) that shows how much of the difference is sampling noise.
- Section 5: teacher caches on the math search split in full mode (float32, float16) and top-K mode: sizes
  on disk against full mode, the mean ESAP bound width for a few pruned candidates, and whether every
  per-sample full-mode ESAP lies within its top-K bounds.
- Section 6: the search stage for REAP and Frequency at 25% and 50% (scores from code calibration, search on
  math, as `make demo`): searched against uniform ESAP on the search samples, on the stage's own held-out
  share (allocation.json) and on the separate `search_heldout` split, with the stage's generalisation check.

Stage outputs are stage-cached under --out (calibrate, cache-logits), so a rerun with the same --out only
repeats the searches.

Examples:
    .venv/bin/python benchmarks/demo_figures.py
    .venv/bin/python benchmarks/demo_figures.py --population 24 --generations 16 --out runs/demo-figures
    .venv/bin/python benchmarks/demo_figures.py --sections 4,5   # skip the searches
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from evoesap import moe, records
from evoesap.machine import runtime
from evoesap.method import allocation as alloc
from evoesap.scoring.evaluator import CandidateEvaluator
from evoesap.scoring.importance import CRITERIA, pruning_order, read_scores
from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
from evoesap.stages.calibrate import CalibrateParams, run_calibrate
from evoesap.stages.search import SearchParams, generalisation, run_search

REPO = Path(__file__).resolve().parents[1]
MAX_LENGTH = 256  # the demo model's context; demo samples are far shorter


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho with average ranks for ties (NaN when either side is constant)."""
    ra, rb = pd.Series(a).rank().to_numpy(), pd.Series(b).rank().to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def layer_scores(scores: pd.DataFrame, criterion: str) -> list[np.ndarray]:
    """Per MoE layer, the criterion's values indexed by expert id."""
    out = []
    for layer in sorted(scores["layer"].unique()):
        rows = scores[scores["layer"] == layer].sort_values("expert")
        out.append(rows[criterion].to_numpy(dtype=np.float64))
    return out


def overlap(x: list[list[int]], y: list[list[int]]) -> float:
    """Mean over layers of how many experts the first halves of two pruning orders share."""
    return float(np.mean([len(set(a[: len(a) // 2]) & set(b[: len(b) // 2])) for a, b in zip(x, y)]))


def dir_bytes(uri: str) -> int:
    """Bytes of the payload files of a local artifact (manifest excluded)."""
    root = Path(uri)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != "manifest.json")


class Run:
    """The world, the output directory and the shared stage settings of one invocation."""

    def __init__(self, args: argparse.Namespace) -> None:
        from evoesap.demo.world import WORLD_FILE, build_demo_world, load_demo_world

        self.args = args
        # a finished world is used as it is (its key is printed), so that figures never wait on a rebuild
        built = (Path(args.world) / WORLD_FILE).exists()
        self.world = load_demo_world(args.world) if built else build_demo_world(args.world, seed=0, profile="default")
        self.model = str(self.world.model_dir)
        self.out = Path(args.out)
        self._net: torch.nn.Module | None = None

    @property
    def net(self) -> torch.nn.Module:
        if self._net is None:
            self._net = moe.load_pruned(self.model, dtype=torch.float32).eval()
            runtime.use_cpu_threads(runtime.parameter_count(self._net))
        return self._net

    def calibrate(self, domain: str, split: str = "calibration") -> str:
        params = CalibrateParams(samples=self.args.samples, max_length=MAX_LENGTH, batch_size=self.args.batch_size, device="cpu")
        uri = str(self.out / f"calibrate-{domain}-{split}")
        run_calibrate(self.model, str(self.world.data_file(domain, split)), params, uri)
        return uri

    def cache(self, split: str, mode: str = "full", dtype: str = "float32", top_k: int = 64) -> str:
        params = CacheLogitsParams(
            mode=mode,
            top_k=top_k,
            dtype=dtype,
            samples=self.args.samples,
            max_length=MAX_LENGTH,
            batch_size=self.args.batch_size,
            device="cpu",
        )
        name = f"cache-math-{split}-{mode}-{dtype}" + (f"-k{top_k}" if mode == "topk" else "")
        uri = str(self.out / name)
        run_cache_logits(self.model, str(self.world.data_file("math", split)), params, uri)
        return uri


def section_importance(run: Run) -> None:
    """Section 4: do code- and math-derived pruning orders differ?"""
    t0 = time.perf_counter()
    code, math, control = (
        read_scores(run.calibrate(d, s)) for d, s in (("code", "calibration"), ("math", "calibration"), ("code", "search"))
    )
    print("## Code- vs math-derived pruning orders\n")
    print(
        f"Scores from {run.args.samples} samples of each calibration split (one observer pass each). Spearman's rho "
        "per MoE layer between the two score vectors of 16 experts (average ranks for ties), then the mean over "
        "the 4 layers; the control correlates code calibration with {0} other code samples (the code search "
        "split). Overlap: experts shared by the two halves pruned first (8 of 16 per layer), mean over layers.\n".format(
            run.args.samples
        )
    )
    print(
        "| criterion | code vs math: mean rho | per layer | overlap of 8 pruned first | control (code vs code): mean rho | control overlap |"
    )
    print("|---|---|---|---|---|---|")
    for criterion in CRITERIA:
        per_layer = [spearman(a, b) for a, b in zip(layer_scores(code, criterion), layer_scores(math, criterion))]
        ctrl = [spearman(a, b) for a, b in zip(layer_scores(code, criterion), layer_scores(control, criterion))]
        orders = {name: pruning_order(df, criterion) for name, df in (("code", code), ("math", math), ("ctrl", control))}
        print(
            f"| {criterion} | {np.nanmean(per_layer):+.3f} | {', '.join(f'{v:+.2f}' for v in per_layer)} | "
            f"{overlap(orders['code'], orders['math']):.2f} / 8 | {np.nanmean(ctrl):+.3f} | {overlap(orders['code'], orders['ctrl']):.2f} / 8 |"
        )
    print(f"\nWall time: {time.perf_counter() - t0:.1f} s\n")


def candidates(run: Run, scores: pd.DataFrame) -> dict[str, dict[int, list[int]]]:
    """The pruned candidates of the bound-width table: full, uniform REAP 25%/50%, frequency-global 50% (REAP order)."""
    spec = moe.inspect(run.net)
    n, k = spec.num_experts, spec.top_k
    orders = pruning_order(scores, "reap")
    out: dict[str, dict[int, list[int]]] = {"full model": {}}
    for sparsity in (0.25, 0.5):
        r = alloc.uniform(n, k, alloc.budget(sparsity, n, k))
        out[f"uniform REAP {sparsity:.0%} {list(r)}"] = alloc.pruned_sets(r, orders)
    freq = [v.tolist() for v in layer_scores(scores, "frequency")]
    r = alloc.frequency_global(freq, n, k, alloc.budget(0.5, n, k))
    out[f"frequency-global REAP 50% {list(r)}"] = alloc.pruned_sets(r, orders)
    return out


def section_cache(run: Run) -> None:
    """Section 5: top-K cache sizes and ESAP bound widths against full mode."""
    t0 = time.perf_counter()
    vocab = int(run.net.get_output_embeddings().weight.shape[0])
    ks = sorted({min(int(k), vocab) for k in run.args.top_k.split(",") if k})
    caches = {
        ("full", "float32", None): run.cache("search", "full", "float32"),
        ("full", "float16", None): run.cache("search", "full", "float16"),
    }
    for k in ks:
        caches[("topk", run.args.topk_dtype, k)] = run.cache("search", "topk", run.args.topk_dtype, k)
    cands = candidates(run, read_scores(run.calibrate("code")))
    evaluators = {key: CandidateEvaluator(run.net, uri, batch_size=run.args.batch_size) for key, uri in caches.items()}
    reference = evaluators[("full", "float32", None)]
    exact = {name: reference.sample_values(p) for name, p in cands.items()}  # [S] float32 each
    full_bytes = dir_bytes(caches[("full", "float32", None)])
    half_bytes = dir_bytes(caches[("full", "float16", None)])
    positions = reference.cache.meta.num_positions
    print("## Teacher cache size and ESAP bounds\n")
    print(
        f"Math search split, {reference.num_samples} samples, {positions} scored positions, vocabulary {vocab}; "
        f"top-K caches store log-probabilities in {run.args.topk_dtype}"
        + (
            f"; K above the vocabulary is clipped to {vocab}"
            if any(int(k) > vocab for k in run.args.top_k.split(",") if k)
            else ""
        )
        + ". Sizes are the cache's Parquet payload (token ids included), manifest excluded.\n"
    )
    print("| cache | size on disk | vs full float32 | vs full float16 |")
    print("|---|---|---|---|")
    for (mode, dtype, k), uri in caches.items():
        size = dir_bytes(uri)
        label = f"full {dtype}" if mode == "full" else f"top-{k} {dtype}"
        print(f"| {label} | {size / 1024:.1f} KiB | {size / full_bytes:.1%} | {size / half_bytes:.1%} |")
    print(
        "\nESAP per candidate (mean over samples of the per-sample mean over scored positions). Full float32 is the "
        "exact value; for top-K, the mean bound width (upper - lower) and whether the exact value lies within "
        "the bounds for every sample (largest violation in brackets).\n"
    )
    head = " | ".join(f"top-{k} width | top-{k} contains" for k in ks)
    print(f"| candidate | ESAP (full f32) | full f16 - f32 | {head} |")
    print("|---|---|---|" + "---|---|" * len(ks))
    worst = 0.0
    for name, pruned in cands.items():
        value = exact[name]
        half = evaluators[("full", "float16", None)].sample_values(pruned)
        cells = []
        for k in ks:
            lower, upper = evaluators[("topk", run.args.topk_dtype, k)].sample_bounds(pruned)
            violation = float(torch.clamp(torch.maximum(lower - value, value - upper), min=0).max())
            worst = max(worst, violation)
            cells.append(f"{float((upper - lower).mean()):.2e} | {'yes' if violation <= 1e-5 else 'NO'} ({violation:.0e})")
        print(f"| {name} | {float(value.mean()):.5f} | {float((half - value).mean()):+.1e} | {' | '.join(cells)} |")
    print(f"\nLargest bound violation over all candidates, samples and K: {worst:.1e} (tolerance 1e-5).")
    print(f"\nWall time: {time.perf_counter() - t0:.1f} s\n")


def section_search(run: Run) -> None:
    """Section 6: searched vs uniform ESAP on search and held-out samples, with the stage's own check."""
    t0 = time.perf_counter()
    a = run.args
    scores_uri = run.calibrate("code")
    scores = read_scores(scores_uri)
    search_cache = run.cache("search")
    heldout = CandidateEvaluator(run.net, run.cache("search_heldout"), batch_size=a.batch_size)
    rows = []
    for criterion in a.criteria.split(","):
        for sparsity in (float(s) for s in a.sparsities.split(",")):
            params = SearchParams(
                criterion=criterion,
                sparsity=sparsity,
                population=a.population,
                elites=a.elites,
                generations=a.generations,
                seed=a.seed,
                batch_size=a.batch_size,
                device="cpu",
            )
            uri = str(run.out / f"search-{criterion}-{round(sparsity * 100)}")
            t = time.perf_counter()
            run_search(run.model, scores_uri, search_cache, params, uri)
            seconds = time.perf_counter() - t
            doc = records.read(uri, records.AllocationRecord)
            orders = pruning_order(scores, criterion)
            best, uni = doc.searched.removal_counts, doc.uniform.removal_counts
            split = generalisation(
                heldout.sample_values(alloc.pruned_sets(best, orders)).numpy(),
                heldout.sample_values(alloc.pruned_sets(uni, orders)).numpy(),
            )
            rows.append((criterion, sparsity, doc, split, seconds))
    stage_n, search_n = rows[0][2].heldout_samples, rows[0][2].search_samples
    print("## Searched vs uniform allocations\n")
    print(
        f"Scores from code calibration ({a.samples} samples), search on the math search split: {search_n} samples for "
        f"the search, {stage_n} held out by the stage (heldout_fraction {SearchParams.heldout_fraction}, the default); "
        f"the separate `search_heldout` split has {heldout.num_samples} other math samples. Search: population "
        f"{a.population}, elites {a.elites}, generations {a.generations}, seed {a.seed}, other settings the stage "
        "defaults (the paper's P 32 and 50 generations are cut to fit a loaded 2-core CPU). Held-out differences "
        "are paired (searched - uniform, mean ± standard error); the stage's check passes when the difference "
        "exceeds two standard errors.\n"
    )
    print("| criterion | sparsity | uniform r | searched r | evaluations | search time |")
    print("|---|---|---|---|---|---|")
    for criterion, sparsity, doc, _, seconds in rows:
        print(
            f"| {criterion} | {sparsity:.0%} | {list(doc.uniform.removal_counts)} | {list(doc.searched.removal_counts)} | "
            f"{doc.evaluations} | {seconds:.0f} s |"
        )
    print(
        f"\n| criterion | sparsity | search set ({search_n}): uniform | searched | stage held-out ({stage_n}): uniform | "
        f"searched | difference | check passed | search_heldout ({heldout.num_samples}): uniform | searched | difference | beats uniform |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for criterion, sparsity, doc, split, _ in rows:
        h = doc.heldout
        print(
            f"| {criterion} | {sparsity:.0%} | {doc.uniform.fitness:.4f} | {doc.searched.fitness:.4f} | "
            f"{h.uniform:.4f} | {h.searched:.4f} | {h.difference:+.4f} ± {h.stderr:.4f} | "
            f"{'yes' if h.beats_uniform else '**no**'} | {split.uniform:.4f} | {split.searched:.4f} | "
            f"{split.difference:+.4f} ± {split.stderr:.4f} | {'yes' if split.beats_uniform else '**no**'} |"
        )
    print(f"\nWall time: {time.perf_counter() - t0:.1f} s\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--world", default=str(REPO / ".cache" / "demo-world"), help="demo world directory (used as it is; built when missing)"
    )
    parser.add_argument("--out", help="stage outputs; default: a temporary directory")
    parser.add_argument("--sections", default="4,5,6", help="issues whose figures to make")
    parser.add_argument("--samples", type=int, default=64, help="calibration and cache samples per split")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--top-k", default="8,32,128", help="K values of the top-K caches")
    parser.add_argument("--topk-dtype", default="float32", choices=["float16", "float32"])
    parser.add_argument("--criteria", default="reap,frequency")
    parser.add_argument("--sparsities", default="0.25,0.5")
    parser.add_argument("--population", type=int, default=16)
    parser.add_argument("--elites", type=int, default=4)
    parser.add_argument("--generations", type=int, default=12)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--threads",
        type=int,
        help="intra-op threads (sets EVOESAP_CPU_THREADS); default: evoesap.machine.runtime's choice, 1 for tiny models",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        os.environ[runtime.CPU_THREADS_ENV] = str(args.threads)
    tmp = None
    if args.out is None:
        tmp = tempfile.TemporaryDirectory(prefix="demo-figures-")
        args.out = tmp.name
    t0 = time.perf_counter()
    try:
        run = Run(args)
        print(f"Command: `{shlex.join(['.venv/bin/python', 'benchmarks/demo_figures.py', *argv])}`\n")
        print(
            f"Demo world {run.world.key[:12]} ({run.world.profile}, seed {run.world.seed}); torch {torch.__version__}, "
            f"{runtime.cpu_threads(run.world.info['parameters'])} threads, CPU.\n"
        )
        sections = {s.strip() for s in args.sections.split(",")}
        for name, section in (("4", section_importance), ("5", section_cache), ("6", section_search)):
            if name in sections:
                section(run)
                sys.stdout.flush()
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"Total wall time: {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
