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


def run_blocks(page: Path, cwd: Path, *, stderr: bool = False) -> list[str]:
    """Run the page's runnable blocks in order in `cwd` (with `evoesap` this checkout's, also after a block activates
    `.venv`), returning their outputs (with `stderr`, stdout then stderr)."""
    bin_dir = cwd / ".bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "evoesap"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m evoesap "$@"\n')
    shim.chmod(0o755)
    (cwd / ".venv" / "bin").mkdir(parents=True, exist_ok=True)  # what `make install` makes, as `activate` sees it
    (cwd / ".venv" / "bin" / "activate").write_text(f'PATH="{bin_dir}:$PATH"\n')
    (cwd / "examples").exists() or (cwd / "examples").symlink_to(ROOT / "examples")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HOME": str(cwd)}
    outputs = []
    for mark, code in blocks(page):
        if mark != "runnable":
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{page.name} block failed ({done.returncode}):\n{code}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout + done.stderr if stderr else done.stdout)
    return outputs


def test_install_page_commands_run(tmp_path):
    (help_text,) = run_blocks(ROOT / "docs" / "getting-started" / "install.md", tmp_path)
    from evoesap import registry as stages

    assert all(name in help_text for name in stages.NAMES)  # "the eight stage verbs", as the page says


def test_quick_start_first_block_ends_in_the_search_summary_and_its_allocation_is_not_uniform(tmp_path):
    page = ROOT / "docs" / "getting-started" / "quick-start.md"
    first = next(code for mark, code in blocks(page) if mark == "runnable")
    assert first.startswith(". .venv/bin/activate\n"), "the first result's block activates the venv itself"
    search, prune = run_blocks(page, tmp_path, stderr=True)
    allocation = json.loads((tmp_path / "runs" / "quick-search" / "allocation.json").read_text())
    assert allocation["criterion"] == "reap" and sum(allocation["removal_counts"]) == allocation["budget"] > 0
    searched, uniform = allocation["searched"]["removal_counts"], allocation["uniform"]["removal_counts"]
    assert searched != uniform, "the quick start's search has an alternative to uniform and finds it"
    check = allocation["heldout"]
    assert check["beats_uniform"] and check["samples"] > 0 and not allocation.get("warnings")
    summary = [line for line in search.splitlines() if line.startswith("search: ")]
    assert summary == [
        f"search: searched {searched} vs uniform {uniform}, held-out esap {check['searched']:.5f} vs "
        f"{check['uniform']:.5f} ({check['difference']:+.1e}, {check['difference'] / check['stderr']:.1f} standard "
        f"errors, {check['samples']} samples): beats uniform; details: runs/quick-search/allocation.json"
    ]
    assert summary[0] in page.read_text(encoding="utf-8"), "the page shows the line the commands print"
    assert "\nruns/quick-cal\nruns/quick-cache\nruns/quick-search\n" in search  # stdout: each command's result alone
    pruning = json.loads(prune[prune.index("{") : prune.rindex("}") + 1])
    assert pruning["method"] == "searched" and list(pruning["removal_counts"]) == searched
    assert (tmp_path / "runs" / "quick-pruned" / "config.json").is_file()


def test_readme_quick_start_is_the_pages_first_block_and_shows_its_summary():
    page = (ROOT / "docs" / "getting-started" / "quick-start.md").read_text(encoding="utf-8")
    first = next(code for mark, code in BLOCK.findall(page) if mark == "runnable")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"```bash\n{first}```" in readme, "README's quick start runs the same commands as the quick-start page"
    (summary,) = [line for line in page.splitlines() if line.startswith("search: ")]
    assert summary in readme


def test_first_model_plan_runs_offline_and_fits(tmp_path):
    (plan,) = run_blocks(ROOT / "docs" / "getting-started" / "first-model.md", tmp_path)
    rows = [line for line in plan.splitlines() if line.startswith("| ") and line.endswith(" |") and "stage" not in line]
    assert {row.split("|")[1].strip() for row in rows} >= {"calibrate", "cache-logits", "search", "prune", "evaluate"}
    assert all(row.split("|")[-2].strip() == "yes" for row in rows if not row.startswith("|---"))
