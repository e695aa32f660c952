"""Work per candidate of the search, before and after the elite floor, in one run: FFE, seconds, same answer?

For each world and seed, the same level-switch search runs twice on one evaluator setting: "before" with
the elite floor off (today's search), "after" with it on (`level_switch_search(elite_floor=True)`, the
evaluator stopping candidates that provably cannot reach the weakest parent). Both runs of a pair use a
fresh evaluator, interleaved so that machine load hits both alike. Printed per pair: distinct candidates,
FFE per candidate (work actually run / one plain forward over the search samples), seconds per candidate,
the final allocations and fitnesses, and whether they agree (they must: the floor cannot change the course
of the search).

Worlds: `tiny` (the tiny OLMoE of `evoesap.moe.tiny`: 4 MoE layers of 8 experts top-2, vocabulary 256) and
`olmoe` (bench_search's `--shape olmoe-1b-7b`: 16 MoE layers of 64 experts top-8, vocabulary 50304, width 64),
both with random weights and bench_search's random search samples; `--model/--data` adds a demo world.
Pruning orders come from the observer pass over calibration samples (REAP).

    python benchmarks/bench_candidate_work.py                       # tiny and olmoe, 3 seeds
    python benchmarks/bench_candidate_work.py --worlds tiny --seeds 0 1 2 3 4

`--compare` instead runs, per world x criterion x seed and in one process, exact search (no prefix reuse), prefix
reuse, today's racing (prefix reuse + the racing schedule) and statistical racing (prefix reuse +
`racing.Sequential` at `--racing-delta`, in `--racing-waves` waves, its additive model off with `--no-surrogate`,
its zero-forward screen on with `--screen`, off by default as in the search;
`--methods` picks among them), and prints FFE per candidate (in the run and extrapolated to a whole default search of
50 generations from generation 0 and the mean later generation, as bench_search does), wall time per candidate and
the final allocation's full-set ESAP, scored by one plain evaluator (exact search's scoring), with exact search's as
the baseline when it runs. `--out rows.jsonl` appends each search's row as it finishes (a stopped run keeps its
rows); `--table` prints the markdown tables of one or more such files, a later file's rows replacing the same
searches of an earlier one, so one column can be re-run alone:

    python benchmarks/bench_candidate_work.py --compare --worlds tiny --criteria reap frequency --seeds 0 1 2
    python benchmarks/bench_candidate_work.py --compare --worlds tiny --criteria reap --out rows.jsonl
    python benchmarks/bench_candidate_work.py --compare --worlds tiny --criteria reap --methods statistical --out new.jsonl
    python benchmarks/bench_candidate_work.py --table rows.jsonl new.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import work_rows  # noqa: E402
from bench_search import build_shape, load_world, run_search  # noqa: E402

from evoesap import moe  # noqa: E402
from evoesap.errors import EvoESAPError  # noqa: E402
from evoesap.machine import runtime
from evoesap.method import allocation as alloc  # noqa: E402
from evoesap.method.racing import SCREENED  # noqa: E402
from evoesap.moe.tiny import tiny_model  # noqa: E402
from evoesap.scoring import teacher  # noqa: E402
from evoesap.scoring.evaluator import CandidateEvaluator  # noqa: E402
from evoesap.scoring.importance import observe, pruning_order  # noqa: E402


@dataclasses.dataclass
class Run:
    seconds: float
    candidates: int
    ffe: float  # full-forward equivalents in all
    best: tuple[int, ...]
    best_fitness: float


def world(name: str, args: argparse.Namespace):
    """(model, search samples, calibration samples) of a world."""
    shape = argparse.Namespace(
        shape="olmoe-1b-7b",
        max_length=args.max_length,
        samples=args.samples,
        calibration_samples=args.calibration_samples,
        model=args.model,
        data=args.data,
        calibration=None,
        pad_vocab=0,
    )
    if name == "demo":
        return load_world(shape)
    model, tokenized, calibration = build_shape(shape)
    if name == "tiny":  # the same random samples, drawn within the tiny vocabulary
        model = tiny_model("olmoe", seed=0)
        vocab = model.config.vocab_size
        tokenized = [dataclasses.replace(s, input_ids=[3 + t % (vocab - 3) for t in s.input_ids]) for s in tokenized]
        calibration = [dataclasses.replace(s, input_ids=[3 + t % (vocab - 3) for t in s.input_ids]) for s in calibration]
    return model, tokenized, calibration


@contextlib.contextmanager
def cached_world(name: str, args: argparse.Namespace):
    """A world ready to search: its model, a full float16 teacher cache of its search samples (in a temporary folder
    for the block), calibration scores, experts and budget at `args.sparsity`; torch threads set for its size."""
    model, tokenized, calibration = world(name, args)
    runtime.use_cpu_threads(runtime.parameter_count(model))
    spec = moe.inspect(model)
    scores = observe(model, calibration, batch_size=args.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        teacher.write_cache(model, tokenized, Path(tmp), mode="full", dtype="float16", batch_size=args.batch_size)
        yield argparse.Namespace(
            model=model,
            cache=teacher.load_cache(tmp),
            scores=scores,
            n=spec.num_experts,
            k=spec.top_k,
            budget=alloc.budget(args.sparsity, spec.num_experts, spec.top_k),
        )


def one_search(model, cache, orders, n, k, budget, args, seed: int, floor: bool, race: bool) -> Run:
    """One search over every sample, prefix reuse as `--prefix-cache-bytes` says (bench_search's run)."""
    ids = list(range(cache.num_samples))
    row, result, _ = run_search(
        model, cache, orders, n, k, budget, ids, args, prefix=True, race=race, seed=seed, elite_floor=floor
    )
    return Run(row.seconds, row.candidates, row.ffe, result.best, result.best_fitness)


def endings(history) -> list[dict[str, int]]:
    """Per generation, the candidates new in it by where they ended: "full" (scored on the full set) or the racing
    level they stopped at ("-1" screened), each counted once, in the generation it first appeared."""
    seen: set = set()
    out: list[dict[str, int]] = []
    for h in history:
        while len(out) <= h.generation:
            out.append({})
        if h.allocation not in seen:
            seen.add(h.allocation)
            key = "full" if h.level is None else str(h.level)
            out[h.generation][key] = out[h.generation].get(key, 0) + 1
    return out


COMPARED = {"exact": (False, False), "prefix": (True, False), "racing": (True, True), "statistical": (True, "statistical")}
METHOD_ORDER = list(COMPARED)  # exact first: the baseline of the printed table


def settings(args: argparse.Namespace, name: str, method: str, commit: str) -> dict:
    """What a row of `method` ran with: the settings every method shares, then the method's own and the code's commit."""
    out = {key: getattr(args, key) for key in work_rows.SHARED}
    out["prefix_cache_bytes"] = args.prefix_cache_bytes if COMPARED[method][0] else 0
    if method == "racing":
        out |= {k: getattr(args, k) for k in ("racing_schedule", "racing_min_samples", "racing_min_positions")}
    if method == "statistical":
        out |= {"racing_delta": args.racing_delta, "racing_min_samples": args.racing_min_samples}
        out |= {"racing_waves": args.racing_waves, "surrogate": not args.no_surrogate, "screen": args.screen}
        out |= {"racing_tolerance": args.racing_tolerance}
    if name == "demo":
        out["model"] = str(Path(args.model).resolve())
    out["commit"] = commit
    return out


def _commit() -> str:
    """The code's commit, with "+" when the work tree differs from it (read once, when the run starts: the
    code imported then is the code that runs, whatever is committed later)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def compare(args: argparse.Namespace) -> None:
    """Exact, prefix, today's racing and statistical racing on the same data (the module docstring)."""
    print(
        "| world | criterion | seed | method | candidates | FFE / cand. | FFE / cand. whole default search (est.) | "
        "s / cand. | wall s | final full-set ESAP | vs exact | screened | FFE by generation |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    methods = {m: COMPARED[m] for m in METHOD_ORDER if m in args.methods}
    commit = _commit()
    sums: dict[str, list[tuple[float, float, float]]] = {m: [] for m in methods}
    for name in args.worlds:
        with cached_world(name, args) as w:
            model, cache, n, k, budget = w.model, w.cache, w.n, w.k, w.budget
            ids = list(range(cache.num_samples))
            # every final allocation is scored by one plain evaluator (no prefix reuse, no racing): exact search's
            # own scoring, so a file of some methods' rows compares with another file's exact rows
            judge = CandidateEvaluator(
                model, cache, batch_size=args.batch_size, prefix_cache_bytes=0, keep=args.elites, verify=False
            )
            orders_of = {criterion: pruning_order(w.scores, criterion) for criterion in args.criteria}
            for seed in args.seeds:  # seeds outermost: a run stopped early still has every criterion of its first seeds
                for criterion, orders in orders_of.items():
                    base = float("nan")
                    for method, (prefix, race) in methods.items():
                        row, result, _ = run_search(
                            model, cache, orders, n, k, budget, ids, args, prefix=prefix, race=race, seed=seed
                        )
                        esap = judge.score(alloc.pruned_sets(result.best, orders))
                        base = esap if method == "exact" else base
                        whole = row.default_search()[1] / (
                            args.population + 50 * (row.candidates - args.population) / max(1, args.generations)
                        )
                        sums[method].append((row.ffe / row.candidates, whole, esap - base))
                        by_generation = [float(v) for v in np.diff([0.0, *(m[1] for m in row.marks)])]  # FFE of each
                        if args.out:
                            work_rows.append(
                                args.out,
                                {
                                    "world": name,
                                    "criterion": criterion,
                                    "seed": seed,
                                    "method": method,
                                    "candidates": row.candidates,
                                    "ffe_per_candidate": row.ffe / row.candidates,
                                    "ffe_per_candidate_whole_search": whole,
                                    "seconds_per_candidate": row.seconds / row.candidates,
                                    "seconds": row.seconds,
                                    "allocation": list(result.best),
                                    "esap": esap,
                                    "ffe_by_generation": by_generation,
                                    "endings_by_generation": endings(result.history),
                                    "elite_allocations": len({h.allocation for h in result.history if h.elite}),
                                    "settings": settings(args, name, method, commit),
                                },
                            )
                        print(
                            f"| {name} | {criterion} | {seed} | {method} | {row.candidates} | {row.ffe / row.candidates:.3f} | "
                            f"{whole:.3f} | {row.seconds / row.candidates:.4f} | {row.seconds:.1f} | {esap:.6f} | "
                            f"{work_rows.pct(100 * (esap - base) / base)} | {sum(h.level == SCREENED for h in result.history)} | "
                            f"{' '.join(f'{v:.2f}' for v in by_generation)} |",
                            flush=True,
                        )
    print()
    for method, values in sums.items():
        a = np.array(values)
        print(
            f"{method}: mean FFE / candidate {a[:, 0].mean():.3f} (whole default search est. {a[:, 1].mean():.3f}); "
            f"full-set ESAP vs exact: mean {a[:, 2].mean():+.2e}, worst {a[:, 2].min():+.2e}"
        )
    print(
        f"settings: {args.sparsity:.0%}, population {args.population}, elites {args.elites}, {args.generations} generations, "
        f"{args.samples} samples x {args.max_length} tokens, batch {args.batch_size}; racing schedule {args.racing_schedule} "
        f"(minimums {args.racing_min_samples} samples, {args.racing_min_positions} positions); statistical delta "
        f"{args.racing_delta}, tolerance {args.racing_tolerance:g}, first checkpoint {args.racing_min_samples} samples, "
        f"{args.racing_waves} waves, "
        f"additive model {'off' if args.no_surrogate else 'on'}, screen {'on' if args.screen and not args.no_surrogate else 'off'}"
    )
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", nargs="+", default=["tiny", "olmoe"], choices=["tiny", "olmoe", "demo"])
    parser.add_argument("--model", help="with --worlds demo: the demo world's model directory")
    parser.add_argument("--data", nargs="+", help="with --worlds demo: its search JSONL files")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--calibration-samples", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--criterion", default="reap")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--population", type=int, default=32)
    parser.add_argument("--elites", type=int, default=4)
    parser.add_argument("--generations", type=int, default=6)
    parser.add_argument("--prefix-cache-bytes", type=int, default=1 << 30, help="0: no prefix reuse")
    parser.add_argument(
        "--racing", action="store_true", help="also pairs with racing (schedule below, minimums 2 samples, 64 positions)"
    )
    parser.add_argument("--racing-schedule", default="0.25,0.5:0.25")
    parser.add_argument("--racing-min-samples", type=int, default=2)
    parser.add_argument("--racing-min-positions", type=int, default=64)
    parser.add_argument("--racing-delta", type=float, default=0.05, help="statistical racing's error rate (--compare)")
    parser.add_argument(
        "--racing-tolerance", type=float, default=0.0, help="statistical racing's tolerance in fitness (--compare)"
    )
    parser.add_argument("--racing-waves", type=int, default=4, help="statistical racing's waves per generation (--compare)")
    parser.add_argument("--no-surrogate", action="store_true", help="statistical racing without its additive model (--compare)")
    parser.add_argument(
        "--screen", action="store_true", help="statistical racing with its opt-in zero-forward screen (--compare)"
    )
    parser.add_argument(
        "--methods", nargs="+", default=list(COMPARED), choices=list(COMPARED), help="with --compare: the methods to run"
    )
    parser.add_argument("--criteria", nargs="+", default=["reap"], help="with --compare: the criteria to search with")
    parser.add_argument("--compare", action="store_true", help="exact, prefix, racing and statistical racing (docstring)")
    parser.add_argument("--out", help="with --compare: append each search's row to this JSONL file as it finishes")
    parser.add_argument(
        "--table", nargs="+", metavar="ROWS", help="print the tables of these --out files (later rows replace earlier)"
    )
    args = parser.parse_args(argv)
    try:
        if args.table:
            if args.compare or args.out:
                parser.error("--table only reads rows: run it without --compare/--out")
            print(work_rows.tables(work_rows.read(args.table)))
            return
        if args.out and not args.compare:
            parser.error(f"--out {args.out} writes --compare's rows: add --compare")
        if args.compare and "demo" in args.worlds and not (args.model and args.data):
            parser.error("--worlds demo needs --model (the demo world's model directory) and --data (its search JSONL files)")
        if args.out:
            args.out = work_rows.check_writable(args.out)
    except EvoESAPError as e:
        parser.exit(1, f"error: {e}\n")
    if args.compare:
        compare(args)
        return
    print(f"machine: {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        "| world | search | seed | candidates | FFE / cand. before | after | ratio | s / cand. before | after | ratio | same best | best fitness |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    totals: dict[str, list[float]] = {"ffe_before": [], "ffe_after": [], "s_before": [], "s_after": []}
    agree = True
    for name in args.worlds:
        with cached_world(name, args) as w:
            model, cache, n, k, budget = w.model, w.cache, w.n, w.k, w.budget
            orders = pruning_order(w.scores, args.criterion)
            for race in (False, True) if args.racing else (False,):
                for seed in args.seeds:
                    before = one_search(model, cache, orders, n, k, budget, args, seed, False, race)
                    after = one_search(model, cache, orders, n, k, budget, args, seed, True, race)
                    same = (before.best, before.best_fitness) == (after.best, after.best_fitness)
                    agree &= same
                    fb, fa = before.ffe / before.candidates, after.ffe / after.candidates
                    sb, sa = before.seconds / before.candidates, after.seconds / after.candidates
                    for key, value in zip(totals, (fb, fa, sb, sa)):
                        totals[key].append(value)
                    print(
                        f"| {name} | {'racing' if race else 'exact'}{'+prefix' if args.prefix_cache_bytes else ''} | {seed} | "
                        f"{before.candidates} | {fb:.3f} | {fa:.3f} | {fa / fb:.2f} | {sb:.4f} | {sa:.4f} | {sa / sb:.2f} | "
                        f"{'yes' if same else 'NO'} | {after.best_fitness:.6f} |",
                        flush=True,
                    )
    mean = {key: sum(v) / len(v) for key, v in totals.items()}
    print(
        f"\nmean FFE per candidate {mean['ffe_before']:.3f} -> {mean['ffe_after']:.3f} "
        f"({mean['ffe_after'] / mean['ffe_before']:.2f}x); seconds per candidate {mean['s_before']:.4f} -> "
        f"{mean['s_after']:.4f} ({mean['s_after'] / mean['s_before']:.2f}x); final allocations agree: {agree}"
    )
    print(
        f"settings: {args.criterion} {args.sparsity:.0%}, population {args.population}, elites {args.elites}, "
        f"{args.generations} generations, {args.samples} samples x {args.max_length} tokens, batch {args.batch_size}"
    )
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))


if __name__ == "__main__":
    main()
