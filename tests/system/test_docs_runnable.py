"""The getting-started pages cannot rot: every shell block there is marked, and the blocks marked runnable run
as written (on the quick demo world and the shipped example configs, offline) and do what the page says."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "getting-started").glob("*.md"))
# A fenced shell block and the HTML comment right above it: <!-- runnable --> or <!-- not-runnable: why -->.
BLOCK = re.compile(r"(?:<!-- (runnable|not-runnable: [^>]+) -->\n)?```(?:bash|sh|shell)\n(.*?)```", re.S)


def blocks(page: Path) -> list[tuple[str | None, str]]:
    return [(mark, code) for mark, code in BLOCK.findall(page.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_shell_block_of_getting_started_is_marked(page):
    unmarked = [code for mark, code in blocks(page) if not mark]
    assert not unmarked, f"{page.name}: mark each shell block <!-- runnable --> or <!-- not-runnable: why -->: {unmarked}"


def run_blocks(page: Path, cwd: Path) -> list[str]:
    """Run the page's runnable blocks in order in `cwd` (with `evoesap` this checkout's), returning their outputs."""
    bin_dir = cwd / ".bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "evoesap"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m evoesap "$@"\n')
    shim.chmod(0o755)
    (cwd / "examples").exists() or (cwd / "examples").symlink_to(ROOT / "examples")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HOME": str(cwd)}
    outputs = []
    for mark, code in blocks(page):
        if mark != "runnable":
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{page.name} block failed ({done.returncode}):\n{code}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    return outputs


def test_install_page_commands_run(tmp_path):
    (help_text,) = run_blocks(ROOT / "docs" / "getting-started" / "install.md", tmp_path)
    from evoesap import registry as stages

    assert all(name in help_text for name in stages.NAMES)  # "the eight stage verbs", as the page says


def test_quick_start_stages_by_hand_run_on_the_quick_world(tmp_path):
    build, search, prune = run_blocks(ROOT / "docs" / "getting-started" / "quick-start.md", tmp_path)
    allocation = json.loads(search[search.index("{") :])  # `cat allocation.json` after the search's own output
    assert allocation["criterion"] == "reap" and allocation["sparsity"] == 0.25
    assert sum(allocation["removal_counts"]) == allocation["budget"] > 0
    assert 0 < allocation["fitness"] <= 1 and allocation["fitness"] >= allocation["uniform"]["fitness"]
    pruning = json.loads(prune[prune.index("{") :])
    assert pruning["method"] == "searched" and list(pruning["removal_counts"]) == allocation["removal_counts"]
    assert (tmp_path / "runs" / "quick-pruned" / "config.json").is_file()


def test_first_model_plan_runs_offline_and_fits(tmp_path):
    (plan,) = run_blocks(ROOT / "docs" / "getting-started" / "first-model.md", tmp_path)
    rows = [line for line in plan.splitlines() if line.startswith("| ") and line.endswith(" |") and "stage" not in line]
    assert {row.split("|")[1].strip() for row in rows} >= {"calibrate", "cache-logits", "search", "prune", "evaluate"}
    assert all(row.split("|")[-2].strip() == "yes" for row in rows if not row.startswith("|---"))
