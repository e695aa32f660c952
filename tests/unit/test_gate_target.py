"""Targets on what the gate checks, and across criteria: a challenger's bracketing from the best so far, the gate as a
probe's judge, the choice of criterion against running each criterion's own target, refusals before any work."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evoesap import records
from evoesap.errors import ConfigError
from evoesap.method import allocation as alloc
from evoesap.planning.target import best, bracket, find, grid, max_probes

N, K = (8, 8, 6, 8), (2, 2, 2, 1)  # experts and the fewest each layer keeps
POINTS = grid(N, K, 1)
BASE = dict(model="/m", calibration_data="/c", search_data="/s", heldout_data="/h")


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200), st.integers(0, 3), st.data())
def test_a_challenger_ends_at_its_first_miss_or_finds_a_meeting_index_above_the_best(size, rechecks, data):
    answers = data.draw(st.lists(st.booleans(), min_size=size, max_size=size))
    start = data.draw(st.integers(0, size - 1))
    chosen, probed = bracket(size, answers.__getitem__, rechecks, start)
    assert probed[0] == start and len(probed) == len(set(probed)) <= max_probes(size, rechecks, start)
    if not answers[start]:
        assert chosen is None and probed == [start]  # one search: it cannot reach the best so far
        return
    assert chosen >= start and answers[chosen]
    above = chosen + 1  # what it stopped at: a probed miss, or the grid's end
    assert above == size or (above in probed and not answers[above])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 120), st.integers(0, 2), st.data())
def test_a_challenger_on_a_monotone_answer_finds_what_a_sweep_finds(size, rechecks, data):
    first_failing = data.draw(st.integers(0, size))
    start = data.draw(st.integers(0, size - 1))
    chosen, _ = bracket(size, lambda i: i < first_failing, rechecks, start)
    sweep = first_failing - 1
    assert chosen == (sweep if sweep >= start else None)


@pytest.mark.parametrize("rechecks", [0, 1, 2])
def test_a_challengers_stated_probes_are_its_true_worst_case(rechecks):
    for size in range(1, 9):  # every answer of every grid up to 8 points, from every start
        for start in range(size):
            most = max(len(bracket(size, lambda i, a=a: bool(a >> i & 1), rechecks, start)[1]) for a in range(2**size))
            assert most == max_probes(size, rechecks, start), (size, start)


def _fake_search(quality, calls=None, root=None):
    """A search whose allocation is the uniform one and whose held-out value is `quality(sparsity)`; with `root`, its
    URI a file there (an input the target artifact's manifest can describe)."""
    calls = [] if calls is None else calls

    def search(sparsity, seed):
        budget = alloc.budget(sparsity, N, K, 1)
        calls.append(sparsity)
        check = records.HeldoutCheck(
            samples=8, searched=quality(sparsity), uniform=0.0, difference=0.0, stderr=0.01, beats_uniform=True,
            searched_stderr=0.002,
        )  # fmt: skip
        record = records.AllocationRecord(
            criterion="reap", sparsity=sparsity, removal_counts=alloc.uniform(N, K, budget, 1), pruned={},
            fitness=quality(sparsity), heldout=check,
        )  # fmt: skip
        if root is None:
            return f"/store/search/{budget}", record
        uri = root / f"search-{budget}"
        uri.write_text(str(quality(sparsity)))
        return str(uri), record

    return search, calls


def _fake_gate(math_score, max_drop=0.05, full=1.0):
    """A judge whose verdict is the gate's task-drop check on a model scoring `math_score(sparsity)` against `full`."""
    judged = []

    def judge(sparsity, search):
        judged.append((sparsity, search))
        value, limit = math_score(sparsity), full - max_drop
        check = records.GateCheck(
            name=f"math acc vs full (max drop {max_drop:g})", value=value, reference=full, limit=limit, passed=value >= limit
        )
        verdict = records.GateRecord(passed=check.passed, candidate=f"/store/prune/{sparsity}", checks=(check,))
        return f"/store/gate/{sparsity}", verdict

    return judge, judged


@pytest.mark.parametrize("drop_at", [0.1, 0.3, 0.55, 0.8, 1.1])
def test_a_gate_target_chooses_the_largest_sparsity_a_sweep_of_verdicts_passes(drop_at):
    """The held-out value meets any threshold everywhere; only the gate's task check decides, as a sweep's would."""

    def score(sparsity):  # math falls off a cliff at `drop_at`
        return 1.0 if sparsity < drop_at else 0.5

    judge, judged = _fake_gate(score)
    search, calls = _fake_search(lambda s: 0.99)
    record = find(None, POINTS, search, N, K, 1, "reap", warm=False, rechecks=1, judge=judge, gate="max_task_drop 0.05")
    passing = [s for s in POINTS if score(s) >= 0.95]
    assert record.chosen == (passing[-1] if passing else None)
    assert [s for s, _ in judged] == calls == [p.sparsity for p in record.probes]  # each probe: a search, then its gate
    assert all(p.gate == f"/store/gate/{p.sparsity}" and p.meets == (score(p.sparsity) >= 0.95) for p in record.probes)
    assert record.metric == "gate" and record.threshold is None and len(record.probes) <= record.max_probes
    assert records.TargetRecord.from_json(record.to_json(), "target.json") == record
    line = record.line()
    if record.chosen is None:
        assert line.startswith("no probed sparsity meets the gate (max_task_drop 0.05) (the lowest sparsity tried, ")
        assert "failed: math acc vs full (max drop 0.05) 0.5000 < 0.9500 (reference 1.0000)" in line
    else:
        assert line.startswith(f"sparsity {record.chosen:.4f} meets the gate (max_task_drop 0.05) (every check passed)")
    if record.chosen is not None and record.chosen != POINTS[-1]:
        up = POINTS[POINTS.index(record.chosen) + 1]
        assert f"the next point up, {up:.4f}, misses (failed: math acc vs full (max drop 0.05) 0.5000 < 0.9500" in line
    assert "within the noise" not in line  # a verdict has no standard error to be within


def test_a_gate_target_is_not_a_held_out_target_in_disguise():
    """The held-out value would choose the grid's top; the gate, which checks what a release manager asks, does not."""
    judge, _ = _fake_gate(lambda s: 1.0 - s)  # the task falls with sparsity; held-out ESAP stays high
    search, _ = _fake_search(lambda s: 0.99)
    held_out = find(0.97, POINTS, search, N, K, 1, "reap", warm=False, rechecks=1)
    gated = find(None, POINTS, search, N, K, 1, "reap", warm=False, rechecks=1, judge=judge, gate="max_task_drop 0.05")
    assert held_out.chosen == POINTS[-1]
    assert gated.chosen == max(s for s in POINTS if 1.0 - s >= 0.95) < held_out.chosen


def _decisions(monkeypatch, tmp_path, qualities, **target):
    """`decide` over fake searches (criterion -> quality(sparsity)), recording every search it asks for."""
    from evoesap.pipeline import target as pipeline_target
    from evoesap.pipeline.config import Target

    calls = {c: [] for c in qualities}
    space = type("Space", (), {"num_experts": N, "min_kept": K, "granularity": 1})()
    monkeypatch.setattr(pipeline_target, "searchable", lambda model, granularity: (space, POINTS))
    monkeypatch.setattr(
        pipeline_target,
        "_search_step",
        lambda root, inputs, section, criterion: _fake_search(qualities[criterion], calls[criterion], tmp_path / criterion)[0],
    )
    inputs = {}
    tmp_path.mkdir(parents=True, exist_ok=True)
    for criterion in qualities:
        (tmp_path / criterion).mkdir()
    for name in ("model", "scores", "cache", "heldout_cache"):
        (tmp_path / name).write_text(name)
        inputs[name] = str(tmp_path / name)
    goal = Target(**target)
    found = pipeline_target.decide(inputs, str(tmp_path / "store"), list(qualities), goal, {})
    return found, calls


QUALITIES = {  # held-out ESAP by criterion: reap holds up to a larger sparsity than frequency, ean ties reap at 0.97
    "frequency": lambda s: 1.0 - 0.2 * s,
    "reap": lambda s: 1.0 - 0.05 * s,
    "ean": lambda s: min(1.0 - 0.05 * s + 0.001, 0.97) if s <= 0.6 else 0.9,
}


@pytest.mark.parametrize("threshold", [0.99, 0.97, 0.95, 0.9])
def test_choosing_the_criterion_matches_each_criterions_own_target_in_fewer_searches(monkeypatch, tmp_path, threshold):
    from evoesap.pipeline.target import fan_out, unmet

    alone, alone_calls = _decisions(monkeypatch, tmp_path / "alone", QUALITIES, heldout_esap=threshold)
    chosen, calls = _decisions(monkeypatch, tmp_path / "chosen", QUALITIES, heldout_esap=threshold, choose_criterion=True)
    answers = {record.criterion: record.chosen for _, record in alone}  # each criterion's own target
    top = max(s for s in answers.values() if s is not None)
    tied = [c for c, s in answers.items() if s == top]
    at = {c: QUALITIES[c](top) for c in tied}
    (point,) = fan_out(chosen, choose=True)
    assert point == {"criterion": max(at, key=at.get), "sparsity": top}  # ties: the higher held-out value
    assert unmet(chosen, choose=True) is None
    assert sum(map(len, calls.values())) < sum(map(len, alone_calls.values()))
    first, *others = [record for _, record in chosen]
    own = next(r for _, r in alone if r.criterion == first.criterion)  # the first bisects the grid as its own target does
    assert first.start is None and [p.sparsity for p in first.probes] == [p.sparsity for p in own.probes]
    for record in others:  # each challenger starts at the best so far, and a loser costs one search
        assert record.start is not None and record.probes[0].sparsity == record.start
        if record.chosen is None:
            assert len(record.probes) == 1 and "the largest sparsity another criterion meets: not chosen" in record.line()


def test_choosing_the_criterion_fails_only_when_no_criterion_meets(monkeypatch, tmp_path):
    from evoesap.pipeline.target import fan_out, unmet

    found, _ = _decisions(
        monkeypatch, tmp_path, {"frequency": lambda s: 0.5, "reap": lambda s: 0.5}, heldout_esap=0.9, choose_criterion=True
    )
    assert fan_out(found, choose=True) == []
    error = unmet(found, choose=True)
    assert isinstance(error, ConfigError) and str(error).startswith("frequency: no probed sparsity meets heldout_esap >= 0.9")


def test_best_breaks_a_tie_by_the_held_out_value_at_the_tied_sparsity():
    def record(criterion, quality):
        search, _ = _fake_search(quality)
        return find(0.9, POINTS, search, N, K, 1, criterion, warm=False, rechecks=0)

    low, high = record("reap", lambda s: 0.95 if s <= 0.5 else 0.5), record("ean", lambda s: 0.96 if s <= 0.5 else 0.5)
    assert low.chosen == high.chosen and best([low, high]) is high and best([high, low]) is high
    assert best([record("seer", lambda s: 0.5)]) is None


@pytest.mark.parametrize(
    "extra, problem",
    [
        ({"target": {"gate": True}}, "sets none: add e.g. gate: {max_task_drop: 0.05}"),
        ({"target": {"gate": True, "heldout_esap": 0.9}, "gate": {"max_task_drop": 0.05}}, "give one target"),
        ({"target": {"gate": True}, "gate": {"max_task_drop": 0.05}, "quantize": {"recipe": "fp8-dynamic"}}, "drop the recipe"),
        ({"target": {"bytes": "1GiB", "choose_criterion": True}}, "target.choose_criterion tunes the probing"),
        ({"target": {"gate": False}}, "give one target"),
    ],
)
def test_bad_gate_and_choice_targets_are_refused_at_load_in_one_line(extra, problem):
    from evoesap.pipeline.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config({**BASE, **extra})
    assert problem in str(info.value) and "\n" not in str(info.value)


def test_a_gate_target_compiles_to_a_finder_that_judges_against_the_full_evaluation(tmp_path):
    import yaml
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.dag import compile_pipeline
    from tiny_world import make_tiny_inputs

    tiny_model = make_tiny_inputs(tmp_path / "tiny")["model"]

    settings_ = {**BASE, "model": tiny_model, "target": {"gate": True, "choose_criterion": True}, "criteria": ["reap", "ean"]}
    config = load_config({**settings_, "gate": {"max_task_drop": 0.05}})
    spec = yaml.safe_load(compile_pipeline(config, str(tmp_path / "p.yaml")).read_text())
    assert spec["root"]["inputDefinitions"]["parameters"]["target_params"]["defaultValue"]["gate"] is True
    tasks = spec["components"]["comp-evoesap-stages"]["dag"]["tasks"]
    finder = tasks["find-sparsities"]["inputs"]
    assert finder["artifacts"]["full_evaluation"]["taskOutputArtifact"] == {
        "outputArtifactKey": "evaluation",
        "producerTask": next(name for name, t in tasks.items() if t["taskInfo"]["name"] == "evaluate full"),
    }
    for stage in ("prune", "evaluate", "gate"):  # the run-time parameters the point's own tasks take
        assert finder["parameters"][f"{stage}_params"]["componentInputParameter"] == f"{stage}_params"
    held_out = load_config({**BASE, "model": tiny_model, "target": {"heldout_esap": 0.9}})
    plain = yaml.safe_load(compile_pipeline(held_out, str(tmp_path / "q.yaml")).read_text())
    inputs = plain["components"]["comp-evoesap-stages"]["dag"]["tasks"]["find-sparsities"]["inputs"]
    assert "full_evaluation" not in inputs.get("artifacts", {})  # a held-out target's searches need not wait for it


def test_a_gate_target_without_the_full_evaluation_is_refused_before_any_search(tmp_path):
    from evoesap.pipeline.config import Target
    from evoesap.pipeline.target import decide

    with pytest.raises(ConfigError, match="compile the pipeline with target: {gate: true}"):
        decide({"model": str(tmp_path)}, str(tmp_path), ["reap"], Target(gate=True), {})


def test_the_command_names_the_chosen_criterion(tmp_path, monkeypatch, capsys):
    import yaml
    from evoesap.pipeline import target as pipeline_target

    from evoesap.cli import main

    found = []
    for criterion, quality in (("reap", lambda s: 1 - s), ("ean", lambda s: 1 - 2 * s)):
        search, _ = _fake_search(quality)
        found.append((f"/runs/target/{criterion}", find(0.9, POINTS, search, N, K, 1, criterion, warm=False, rechecks=1)))
    monkeypatch.setattr(pipeline_target, "cost_line", lambda config: "cost")
    monkeypatch.setattr(pipeline_target, "run_target", lambda config: found)
    config = tmp_path / "target.yaml"
    config.write_text(
        yaml.safe_dump({**BASE, "criteria": ["reap", "ean"], "target": {"heldout_esap": 0.9, "choose_criterion": True}})
    )
    assert main(["pipeline", "target", str(config)]) == 0
    out = capsys.readouterr().out.splitlines()
    probes = sum(len(r.probes) for _, r in found)
    assert out[-1] == f"chosen: reap at sparsity {found[0][1].chosen:.4f}, the largest any criterion reaches ({probes} probes)"


@pytest.mark.slow
def test_a_gate_target_on_real_stages_matches_a_sweep_of_verdicts_and_reuses_its_artifacts(tmp_path):
    """Real search, prune, evaluate and gate artifacts. A sweep of verdicts over every grid point (the judge's own
    steps) decides which sparsities pass; the gate target chooses the largest, makes nothing but its verdicts and its
    decision (each search, prune and evaluation is the sweep's), and a second run makes nothing at all."""
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.target import Gating, _search_step, run_target
    from tiny_world import make_tiny_inputs

    from evoesap.store import artifacts

    files = make_tiny_inputs(tmp_path / "tiny")  # 4 MoE layers of 8 experts, top-2: 6 grid points at granularity 4
    root = str(tmp_path / "store")
    settings_ = {
        "model": files["model"], "calibration_data": files["calibration"], "search_data": files["search"],
        "heldout_data": files["heldout"], "storage_root": root,
        "calibrate": {"samples": 8, "max_length": 128},
        "cache_logits": {"samples": 6, "max_length": 128, "dtype": "float32"},
        "search": {"population": 4, "elites": 1, "generations": 1, "batch_size": 8, "granularity": 4},
        "evaluate": {"tasks": [files["tasks"]], "limit": 2, "batch_size": 2, "max_length": 128},
        "target": {"gate": True, "rechecks": 0},
    }  # fmt: skip

    def made():
        return {str(p.parent.relative_to(root)) for p in (tmp_path / "store").glob("*/*/manifest.json")}

    permissive = load_config({**settings_, "gate": {"min_heldout_esap": 0.01}})
    ((uri, climbed),) = run_target(permissive)
    assert climbed.chosen == climbed.grid[-1] and all(p.meets for p in climbed.probes)  # every verdict passes
    manifest = artifacts.read_manifest(uri, "target")
    inputs = {k: manifest.inputs[k]["uri"] for k in ("model", "scores", "cache", "heldout_cache")}
    sections = {stage: permissive.stage_params(stage) for stage in ("prune", "evaluate", "gate")}
    judge = Gating(manifest.inputs["full_evaluation"]["uri"], None, sections).judge(root, inputs, "reap")
    search = _search_step(root, inputs, permissive.stage_params("search"), "reap")
    esap = {}  # the sweep: every grid point's held-out ESAP, as its verdict read it
    for sparsity in climbed.grid:
        _, verdict = judge(sparsity, search(sparsity, None)[0])
        assert verdict.name == f"reap at sparsity {sparsity:.4f} (searched)"
        esap[sparsity] = verdict.checks[0].value
    threshold = esap[climbed.grid[len(climbed.grid) // 2]]  # the middle point passes at exactly its own value
    passing = [s for s in climbed.grid if esap[s] >= threshold]

    swept = made()
    strict = load_config({**settings_, "gate": {"min_heldout_esap": threshold}})
    ((_, record),) = run_target(strict)
    new = made() - swept
    assert sorted(n.split("/")[0] for n in new) == ["gate"] * len(record.probes) + ["target"]  # the sweep's, reused
    assert all(p.meets == (esap[p.sparsity] >= threshold) for p in record.probes)
    if passing == climbed.grid[: len(passing)]:  # quality falling with sparsity: bisection finds the sweep's answer
        assert record.chosen == passing[-1]
    else:  # else a meeting point whose next point up misses (bracketing's promise without re-checks)
        up = climbed.grid.index(record.chosen) + 1
        assert esap[record.chosen] >= threshold and (up == len(climbed.grid) or esap[climbed.grid[up]] < threshold)
    assert run_target(strict)[0][1] == record and made() == swept | new  # again: nothing to redo


def test_the_report_heads_a_choice_with_one_chosen_criterion_and_the_others_not_chosen():
    from evoesap.stages.report import _decision

    def record(criterion, quality, start=None):
        search, _ = _fake_search(quality)
        return find(0.9, POINTS, search, N, K, 1, criterion, warm=False, rechecks=0, start=start)

    first = record("reap", lambda s: 0.95 if s <= 0.5 else 0.5)
    at = POINTS.index(first.chosen)
    tied = record("ean", lambda s: 0.96 if s <= 0.5 else 0.5, at)  # ties reap, a higher held-out value there
    beaten = record("frequency", lambda s: 0.5, at)
    decisions = [first, tied, beaten]
    assert [_decision(d, decisions) for d in decisions] == ["NOT CHOSEN", "CHOSEN", "NOT CHOSEN"]
    alone = [first, record("seer", lambda s: 0.5)]  # each criterion's own target: chosen where it meets
    assert [_decision(d, alone) for d in alone] == ["CHOSEN", "UNMET"]
