#!/usr/bin/env bash
# One prepared GPU run for search speed: OLMoE-1B-7B and Qwen3-30B-A3B shapes (random weights, real
# dimensions), each with the batched reference scorer, exact, prefix, a truncated default search with racing
# timed without and then with the elite floor, then with statistical racing (each search's time and FFE per
# candidate extrapolated to a whole default search of 50 generations, so one run gives both racing modes'
# figures), and one candidate's time by part (profile_candidate.py). It installs nothing from the network:
# a missing package comes only from wheels carried in images/wheels (pip --no-index). One Python process
# runs every step (benchmarks/gpu_search.py and profile_candidate.py, called as they are); a step that would
# start after BUDGET_S seconds (default 540: 9 minutes) is skipped and says so, so the whole fits 10 minutes.
#
#   benchmarks/gpu_session.sh [OUT_DIR]              # on one H100 or H200
#   benchmarks/gpu_session.sh --dry-run [OUT_DIR]    # the same code path at test size on the CPU (CI)
#
# Output: the tables on stdout, and OUT_DIR/run.log and OUT_DIR/profile.jsonl when OUT_DIR is given.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
if [[ "${1:-}" == "--dry-run" ]]; then
    dry=1
    shift
fi
out="${1:-}"
python="${PYTHON:-python}"

if ! "$python" -c "import torch, transformers" 2>/dev/null; then
    if compgen -G "images/wheels/*.whl" >/dev/null; then
        "$python" -m pip install --no-index --find-links images/wheels transformers
    else
        echo "gpu_session: torch/transformers missing and no wheels in images/wheels: install them first" >&2
        exit 2
    fi
fi
[[ -n "$out" ]] && mkdir -p "$out"

PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DRY="$dry" OUT_DIR="$out" BUDGET_S="${BUDGET_S:-540}" \
    "$python" - <<'EOF' 2>&1 | { if [[ -n "$out" ]]; then tee "$out/run.log"; else cat; fi; }
import os, sys, time

sys.path.insert(0, "benchmarks")
import gpu_search
import profile_candidate

dry, out, budget = os.environ["DRY"] == "1", os.environ["OUT_DIR"], float(os.environ["BUDGET_S"])
start = time.perf_counter()
tiny = ["--tiny", "--device", "cpu", "--samples", "4", "--length", "32", "--prefix-cache-gib", "0.01"]
# shape -> (gpu_search arguments, profile_candidate arguments); paper size on the GPU, test size in a dry run
steps = {
    "olmoe": (
        ["--samples", "64", "--children", "2", "--prefix-cache-gib", "24", "--search-generations", "2"],
        ["--size", "real", "--samples", "16", "--length", "4096"],
    ),
    "qwen3": (
        ["--samples", "32", "--children", "2", "--prefix-cache-gib", "4", "--search-generations", "1"],
        ["--size", "real", "--samples", "8", "--length", "4096", "--prefix-cache-gib", "4"],
    ),
}
for shape, (search_args, profile_args) in steps.items():
    if dry:
        search_args = [*tiny, "--search-generations", "1"]
        profile_args = ["--size", "tiny", "--samples", "2", "--length", "32", "--device", "cpu"]
    common = ["--racing", "--elite-floor", "--statistical"]
    for name, run in (
        ("search", lambda: gpu_search.main(["--shapes", shape, *search_args, *common])),
        ("profile", lambda: profile_candidate.main(
            ["--shape", shape, *profile_args, *(["--json", os.path.join(out, "profile.jsonl")] if out else [])]
        )),
    ):
        elapsed = time.perf_counter() - start
        if elapsed > budget:
            print(f"\n## {shape} {name}: skipped, {elapsed:.0f} s of the {budget:.0f} s budget spent", flush=True)
            continue
        print(f"\n## {shape} {name} (at {elapsed:.0f} s)", flush=True)
        run()
print(f"\ntotal: {time.perf_counter() - start:.0f} s{' (dry run)' if dry else ''}")
EOF
