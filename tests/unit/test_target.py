"""The quality target: the grid, bisection against a brute-force sweep, warm starts, refusals before any work."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evoesap import records
from evoesap.errors import ConfigError
from evoesap.method import allocation as alloc
from evoesap.planning.target import bracket, find, grid, max_probes, warm_start

N, K = (8, 8, 6, 8), (2, 2, 2, 1)  # experts and the fewest each layer keeps


@pytest.mark.parametrize("granularity", [1, 2, 3])
def test_grid_is_every_searchable_budget_once(granularity):
    points = grid(N, K, granularity)
    budgets = [alloc.budget(s, N, K, granularity) for s in points]
    expected = [
        b
        for b in range(1, sum(n - k for n, k in zip(N, K)) + 1)
        if b % granularity == 0 and alloc.FeasibleSet(N, K, b, granularity).size >= 2
    ]
    assert budgets == expected and points == sorted(points)


def _monotone_with_dips(first_failing, dips):
    """An answer where indices below `first_failing` meet but the `dips` (each with a meeting index above it)."""
    return lambda i: i < first_failing and i not in dips


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 80), st.integers(0, 3), st.data())
def test_bracketing_finds_what_a_sweep_finds_through_isolated_dips(size, rechecks, data):
    first_failing = data.draw(st.integers(0, size))  # indices below it meet, the rest do not ...
    below = list(range(first_failing - 1))  # ... but for isolated one-point dips, each under a meeting index
    dips = set()
    for d in data.draw(st.lists(st.sampled_from(below), max_size=rechecks, unique=True)) if below else ():
        if d - 1 not in dips and d + 1 not in dips:
            dips.add(d)
    meets = _monotone_with_dips(first_failing, dips)
    chosen, probed = bracket(size, meets, rechecks)
    sweep = [i for i in range(size) if meets(i)]
    assert chosen == (sweep[-1] if sweep else None)  # the largest meeting index, dips or not
    assert len(probed) == len(set(probed)) <= max_probes(size, rechecks)
    if not dips:  # a monotone answer: bisection and at most one re-check
        assert len(probed) <= math.ceil(math.log2(size + 1)) + min(rechecks, 1)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300), st.integers(0, 3), st.data())
def test_bracketing_any_answer_stays_within_its_stated_probes_and_returns_a_meeting_index(size, rechecks, data):
    answers = data.draw(st.lists(st.booleans(), min_size=size, max_size=size))
    chosen, probed = bracket(size, answers.__getitem__, rechecks)
    assert len(probed) == len(set(probed)) <= max_probes(size, rechecks)
    assert chosen is None or (answers[chosen] and chosen in probed)
    above = 0 if chosen is None else chosen + 1  # what it stopped at: a probed miss, or the grid's end
    assert above == size or (above in probed and not answers[above])


@pytest.mark.parametrize("rechecks", [0, 1, 2])
def test_the_stated_probes_are_the_true_worst_case(rechecks):
    for size in range(1, 11):  # every answer of every grid up to 10 points: the bound is reached and never passed
        most = max(len(bracket(size, lambda i, a=a: bool(a >> i & 1), rechecks)[1]) for a in range(2**size))
        assert most == max_probes(size, rechecks), size
    assert max_probes(27, 0) == math.ceil(math.log2(28))  # plain bisection
    assert max_probes(27, rechecks) < 27  # fewer than a sweep of the demo world's grid


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=4, max_size=4), st.data())
def test_a_warm_start_is_feasible_for_the_new_budget(counts, data):
    neighbour = [min(c, n - k) for c, n, k in zip(counts, N, K)]
    budget = data.draw(st.integers(1, sum(n - k for n, k in zip(N, K))))
    seed = warm_start(neighbour, N, K, budget, 1)
    assert alloc.is_feasible(seed, N, K, budget, 1)


def _fake_search(quality, stderr=0.002):
    """A search whose searched allocation is the proportional one and whose held-out value is `quality(sparsity)`, the
    mean of 8 samples with standard error `stderr`."""
    calls = []

    def search(sparsity, seed):
        budget = alloc.budget(sparsity, N, K, 1)
        if seed is not None:
            assert alloc.is_feasible(seed, N, K, budget, 1)
        calls.append((sparsity, seed))
        counts = alloc.uniform(N, K, budget, 1)
        check = records.HeldoutCheck(
            samples=8, searched=quality(sparsity), uniform=0.0, difference=0.0, stderr=0.01, beats_uniform=True,
            searched_stderr=stderr,
        )  # fmt: skip
        record = records.AllocationRecord(
            criterion="reap", sparsity=sparsity, removal_counts=counts, pruned={}, fitness=quality(sparsity), heldout=check
        )
        return f"/store/search/{budget}", record

    return search, calls


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("threshold", [0.99, 0.9, 0.75, 0.5, 0.2])
def test_find_chooses_the_largest_sparsity_a_sweep_says_meets_the_target(threshold, warm):
    points = grid(N, K, 1)
    search, calls = _fake_search(lambda s: 1 - s)  # quality falls as sparsity rises
    record = find(threshold, points, search, N, K, 1, "reap", warm=warm, rechecks=1)
    meeting = [s for s in points if 1 - s >= threshold]
    assert record.chosen == (meeting[-1] if meeting else None)
    assert len(record.probes) == len(calls) <= record.max_probes < len(points)
    if warm:  # seeded from the nearest probe
        assert record.probes[0].warm_start is None and all(p.warm_start is not None for p in record.probes[1:])
    else:  # each probe the cold search a sweep makes at that sparsity
        assert all(seed is None for _, seed in calls) and all(p.warm_start is None for p in record.probes)
    assert record.warm_start is warm and record.rechecks == 1
    assert all(p.meets == (p.heldout >= threshold) and p.stderr == 0.002 for p in record.probes)
    assert records.TargetRecord.from_json(record.to_json(), "target.json") == record
    if record.chosen is None:
        assert "no probed sparsity meets" in record.line()


@pytest.mark.parametrize("threshold", [0.9, 0.75, 0.5])
def test_find_looks_past_a_search_that_misses_below_the_answer(threshold):
    points = grid(N, K, 1)
    answer = max(i for i, s in enumerate(points) if 1 - s >= threshold)
    _, path = bracket(len(points), lambda i: i <= answer, 0)
    dip = max(i for i in path if i < answer)  # a point plain bisection probes on its way to the answer ...
    quality = {s: threshold - 0.01 if i == dip else 1 - s for i, s in enumerate(points)}  # ... searched badly there
    sweep = [s for s in points if quality[s] >= threshold]
    assert sweep[-1] == points[answer]
    plain, _ = _fake_search(quality.get)
    assert find(threshold, points, plain, N, K, 1, "reap", warm=False, rechecks=0).chosen == points[dip - 1]
    search, calls = _fake_search(quality.get)
    record = find(threshold, points, search, N, K, 1, "reap", warm=False, rechecks=1)
    assert record.chosen == sweep[-1] and len(calls) <= record.max_probes
    assert [p.meets for p in record.probes if p.sparsity == points[dip]] == [False]  # the dip stays in the record


@pytest.mark.parametrize("value", [0.0, 1.0, 1.5, -0.2, True])
def test_a_target_no_pruning_can_meet_or_that_asks_nothing_is_refused(value):
    from evoesap.planning.target import check_threshold

    with pytest.raises(ConfigError, match="target.heldout_esap"):
        check_threshold(value)


BASE = dict(model="/m", calibration_data="/c", search_data="/s", heldout_data="/h")


@pytest.mark.parametrize(
    "extra, problem",
    [
        ({"target": {"heldout_esap": 1.2}}, "unreachable"),
        ({"target": {"heldout_esap": -0.1}}, "unreachable"),
        ({"target": {"heldout_esap": 0.9}, "sparsities": [0.5]}, "target and sparsities"),
        ({"target": {"heldout_esap": 0.9}, "heldout_data": None}, "set heldout_data"),
        ({"target": {"kl": 0.1}}, "valid: bytes, choose_criterion, gate, heldout_esap"),
        ({"target": {"heldout_esap": 0.9, "bytes": "1GiB"}}, "give one target"),
        ({"target": {"heldout_esap": 0.9}, "search": {"metric": "kl"}}, "search.metric is 'kl'"),
        ({"target": {"heldout_esap": 0.9, "rechecks": -1}}, "rechecks"),
        ({"target": {"bytes": "1GiB", "warm_start": True}}, "target.warm_start tunes the probing of heldout_esap or gate"),
    ],
)
def test_bad_targets_are_refused_at_load_in_one_line(extra, problem):
    from evoesap.pipeline.config import load_config

    with pytest.raises(ConfigError, match=problem) as refused:
        load_config({**BASE, **extra})
    assert "\n" not in str(refused.value)


def test_plan_states_the_most_searches_in_advance(tmp_path):
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.target import cost_line
    from tiny_world import quick_world_config

    model = quick_world_config(tmp_path / "model")  # 2 MoE layers of 4 experts, top-2
    config = load_config({**BASE, "model": str(model), "target": {"heldout_esap": 0.97}})
    points = grid((4, 4), (2, 2), 1)  # budgets 1..3 (4 leaves a single allocation)
    assert len(points) == 3
    line = cost_line(config)
    assert f"over {len(points)} grid sparsities" in line and f"at most {max_probes(3, 1)} per criterion" in line
    assert "cold (a sweep's) searches" in line
    warm = load_config({**BASE, "model": str(model), "target": {"heldout_esap": 0.97, "warm_start": True, "rechecks": 0}})
    assert f"at most {max_probes(3, 0)} per criterion" in cost_line(warm) and "warm-started" in cost_line(warm)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_world import make_tiny_inputs

    return make_tiny_inputs(tmp_path_factory.mktemp("tiny"))["model"]


def _written(model_dir: str, counts, tmp_path) -> int:
    """Bytes on disk of the checkpoint prune writes with `counts` experts removed per layer: prune run, files summed."""
    from evoesap import moe

    out = tmp_path / "-".join(map(str, counts))
    if not out.exists():
        moe.prune_checkpoint(model_dir, {layer: list(range(c)) for layer, c in enumerate(counts) if c}, out)
    return sum(p.stat().st_size for p in out.iterdir())


TINY = ((8, 8, 8, 8), (2, 2, 2, 2))  # make_tiny_inputs: 4 MoE layers of 8 experts, top-2


def _largest(model_dir: str, sparsity: float, tmp_path) -> int:
    """The largest checkpoint an allocation at that grid sparsity writes: the uniform one and three others drawn from
    the feasible set (they differ only by the modeling file a non-uniform one adds, and digits)."""
    import random

    n, k = TINY
    budget = alloc.budget(sparsity, n, k, 1)
    space = alloc.FeasibleSet(n, k, budget, 1)
    rng = random.Random(budget)
    drawn = [space.unrank(rng.randrange(space.size)) for _ in range(3)]
    return max(_written(model_dir, c, tmp_path) for c in [alloc.uniform(n, k, budget, 1), *drawn])


@pytest.fixture(scope="module")
def written_sizes(tiny_model, tmp_path_factory):
    """(every grid point's largest written checkpoint, the full model's, the floor's: every layer at top-k experts)."""
    tmp = tmp_path_factory.mktemp("pruned")
    points = grid(*TINY, 1)
    return (
        [_largest(tiny_model, s, tmp) for s in points],
        _written(tiny_model, (0,) * 4, tmp),
        _written(tiny_model, (6,) * 4, tmp),
    )


def test_a_memory_target_picks_the_least_grid_sparsity_whose_written_checkpoint_fits(tiny_model, written_sizes):
    """Bytes are the files prune writes (headers, config, tokenizer, a non-uniform checkpoint's modeling file), not
    tensor bytes: at each budget the chosen point's checkpoints fit and the point below's largest does not."""
    from evoesap.pipeline.config import load_config

    sizes, full, floor = written_sizes
    points = grid(*TINY, 1)
    assert sizes == sorted(sizes, reverse=True) and floor < sizes[-1] < sizes[0] < full
    picks = (0, 3, 7, 12, 20)
    budgets = [full - 1] + [sizes[i] for i in picks] + [sizes[i] - 1 for i in picks[1:]]
    assert len(budgets) == 10
    for budget in budgets:
        ((point),) = load_config({**BASE, "model": tiny_model, "target": {"bytes": budget}}).grid()
        chosen = points.index(point["sparsity"])
        assert sizes[chosen] <= budget, (budget, chosen)
        assert (full if chosen == 0 else sizes[chosen - 1]) > budget, (budget, chosen)
    config = load_config({**BASE, "model": tiny_model, "target": {"bytes": sizes[10]}})
    from evoesap.pipeline.target import cost_line, run_target

    for bracketing in (cost_line, run_target):  # nothing to bracket: refused in one line, not run with no threshold
        with pytest.raises(ConfigError, match="no quality target"):
            bracketing(config)


def test_a_memory_target_names_the_real_floor_and_the_full_checkpoint(tiny_model, written_sizes):
    """The floor is the smallest checkpoint prune writes (every layer at its fewest experts), not the last searchable
    point; a budget between them fits only the floor, which has nothing to search, and says so."""
    from evoesap.pipeline.config import load_config

    sizes, full, floor = written_sizes
    cases = [
        (full, f"at least the full checkpoint's {full:,} bytes on disk: nothing needs pruning"),
        (floor - 1, f"below the model's floor, its smallest checkpoint: {floor:,} bytes"),
        (floor, f"below the smallest searchable checkpoint, {sizes[-1]:,} bytes .* only the model's floor \\({floor:,}"),
        (sizes[-1] - 1, "below the smallest searchable checkpoint"),
    ]
    for budget, problem in cases:
        with pytest.raises(ConfigError, match=problem) as refused:
            load_config({**BASE, "model": tiny_model, "target": {"bytes": budget}})
        assert "\n" not in str(refused.value)
    ((point),) = load_config({**BASE, "model": tiny_model, "target": {"bytes": full - 1}}).grid()
    assert point["sparsity"] == grid(*TINY, 1)[0]  # a byte under the full model: the least pruning, not "nothing"


@pytest.mark.parametrize("size, problem", [("1K", "below the model's floor"), ("100GiB", "nothing needs pruning")])
def test_a_memory_target_out_of_reach_is_refused_in_one_line(tiny_model, size, problem):
    from evoesap.pipeline.config import load_config

    with pytest.raises(ConfigError, match=problem) as refused:  # at load: before any stage runs
        load_config({**BASE, "model": tiny_model, "target": {"bytes": size}})
    assert "\n" not in str(refused.value)


def test_a_quality_target_compiles_to_a_finder_task_whose_points_feed_the_fan_out(tiny_model, tmp_path):
    """The DAG fans out over what the finder task returns, not over a compiled grid; the threshold is a pipeline
    input a submit can override, and the grid input, which nothing would read, is gone."""
    import yaml
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.dag import compile_pipeline

    config = load_config({**BASE, "model": tiny_model, "target": {"heldout_esap": 0.9}})
    spec = yaml.safe_load(compile_pipeline(config, str(tmp_path / "p.yaml")).read_text())
    inputs = spec["root"]["inputDefinitions"]["parameters"]
    assert "grid" not in inputs
    assert inputs["target_params"]["defaultValue"] == {
        "heldout_esap": 0.9,
        "gate": False,
        "choose_criterion": False,
        "warm_start": False,
        "rechecks": 1,
    }
    executors = spec["deploymentSpec"]["executors"]
    assert any("def find_sparsities(" in " ".join(e["container"].get("command", [])) for e in executors.values())
    stages = spec["components"]["comp-evoesap-stages"]["dag"]["tasks"]
    (loop,) = [task["parameterIterator"] for task in stages.values() if "parameterIterator" in task]
    assert loop["items"]["inputParameter"] == "pipelinechannel--find-sparsities-Output"


def test_a_quality_targets_decisions_feed_the_report_and_a_check_after_it(tiny_model, tmp_path):
    """The compiled DAG hands the finder's decisions to the report and to the task after it that ends the run on a
    missed criterion; a configuration without a target has neither."""
    import yaml
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.dag import compile_pipeline

    config = load_config({**BASE, "model": tiny_model, "target": {"heldout_esap": 0.9}})
    tasks = yaml.safe_load(compile_pipeline(config, str(tmp_path / "p.yaml")).read_text())["components"]["comp-evoesap-stages"]
    tasks = tasks["dag"]["tasks"]
    decisions = {"taskOutputArtifact": {"outputArtifactKey": "decisions", "producerTask": "find-sparsities"}}
    assert tasks["report"]["inputs"]["artifacts"]["decisions"] == decisions
    (check,) = [t for t in tasks.values() if t["componentRef"]["name"].startswith("comp-check-targets")]
    assert check["inputs"]["artifacts"]["decisions"] == decisions and "report" in check["dependentTasks"]
    plain = load_config({**BASE, "model": tiny_model, "sparsities": [0.5]})
    tasks = yaml.safe_load(compile_pipeline(plain, str(tmp_path / "q.yaml")).read_text())["components"]["comp-evoesap-stages"]
    assert "decisions" not in tasks["dag"]["tasks"]["report"]["inputs"]["artifacts"]
    assert not [t for t in tasks["dag"]["tasks"].values() if t["componentRef"]["name"].startswith("comp-check-targets")]


@pytest.mark.slow
def test_target_probes_are_the_searches_a_sweep_makes_and_warm_starts_are_opt_in(tmp_path):
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.target import run_target
    from tiny_world import make_tiny_inputs

    from evoesap.steps import run_step
    from evoesap.store import artifacts

    files = make_tiny_inputs(tmp_path / "tiny")  # 4 MoE layers of 8 experts, top-2
    storage = tmp_path / "store"
    settings_ = {
        "model": files["model"],
        "calibration_data": files["calibration"],
        "search_data": files["search"],
        "heldout_data": files["heldout"],
        "storage_root": str(storage),
        "calibrate": {"samples": 8, "max_length": 128},
        "cache_logits": {"samples": 6, "max_length": 128, "dtype": "float32"},
        "search": {"population": 4, "elites": 1, "generations": 1, "batch_size": 8, "granularity": 4},
        "target": {"heldout_esap": 0.5},  # met everywhere: bisection climbs to the top of the grid
    }

    def searches():
        return sorted(p.name for p in (storage / "search").iterdir() if (p / "manifest.json").exists())

    config = load_config(settings_)
    ((uri, record),) = run_target(config)
    assert record.chosen == record.grid[-1] and len(record.probes) <= record.max_probes and not record.warm_start
    assert len(searches()) == len(record.probes)
    manifest = artifacts.read_manifest(uri, "target")
    probes = [manifest.inputs[f"probes.{i}"]["manifest_sha256"] for i in range(len(record.probes))]
    assert probes == [artifacts.manifest_sha256(str(storage / "search" / p.search.rsplit("/", 1)[-1])) for p in record.probes]
    inputs = {k: manifest.inputs[k]["uri"] for k in ("model", "scores", "cache", "heldout_cache")}
    for probe in record.probes:  # cold: the very artifact a sweep's search at that sparsity is
        swept = run_step("search", str(storage), inputs, {**config.stage_params("search"), "criterion": "reap",
                                                           "sparsity": probe.sparsity})  # fmt: skip
        assert artifacts.redact(swept) == probe.search and probe.warm_start is None
    assert len(searches()) == len(record.probes)  # every one reused
    again = run_target(config)  # every probe reused: no new search artifact
    assert again[0][1] == record and len(searches()) == len(record.probes)

    warm = load_config({**settings_, "target": {"heldout_esap": 0.5, "warm_start": True}})
    ((warm_uri, warmed),) = run_target(warm)
    assert warmed.warm_start and warm_uri != uri and warmed.probes[0] == record.probes[0]  # the first: the cold one
    for probe in warmed.probes[1:]:  # warm-started, the seed recorded in the search's own parameters
        params = artifacts.read_manifest(str(storage / "search" / probe.search.rsplit("/", 1)[-1])).params
        assert params["warm_start"] == ",".join(map(str, probe.warm_start))
    assert len(searches()) == len(record.probes) + len(warmed.probes) - 1


def test_an_unmet_target_names_the_lowest_sparsity_tried_not_the_first():
    points = grid(N, K, 1)
    search, _ = _fake_search(lambda s: 0.5 - s)  # every point misses 0.9
    record = find(0.9, points, search, N, K, 1, "reap", warm=False, rechecks=1)
    assert record.chosen is None and record.probes[0].sparsity != points[0]  # bisection starts in the middle
    lowest = min(record.probes, key=lambda p: p.sparsity)
    assert lowest.sparsity == points[0]  # bisection only gives up after the lowest point missed
    assert f"the lowest sparsity tried, {points[0]:.4f}: {0.5 - points[0]:.4f}" in record.line()


def test_an_unmet_target_ends_the_command_as_an_error_line_like_any_other(tmp_path, monkeypatch, capsys):
    import yaml
    from evoesap.pipeline import target as pipeline_target

    from evoesap.cli import main

    points = grid(N, K, 1)
    found = []
    for criterion, quality in (("reap", lambda s: 1 - s), ("ean", lambda s: 0.5 - s)):
        search, _ = _fake_search(quality)
        found.append((f"/runs/target/{criterion}", find(0.9, points, search, N, K, 1, criterion, warm=False, rechecks=1)))
    monkeypatch.setattr(pipeline_target, "cost_line", lambda config: "cost")
    monkeypatch.setattr(pipeline_target, "run_target", lambda config: found)
    config = tmp_path / "target.yaml"
    config.write_text(yaml.safe_dump({**BASE, "target": {"heldout_esap": 0.9}}))
    assert main(["pipeline", "target", str(config)]) == 1
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ean: no probed sparsity meets heldout_esap >= 0.9 (the lowest sparsity tried, ")
    assert out.splitlines() == ["cost", f"reap: {found[0][1].line()}", "/runs/target/reap", "/runs/target/ean"]


def test_a_memory_target_takes_a_number_of_bytes_as_a_size_does(tiny_model, written_sizes):
    from evoesap.pipeline.config import load_config

    points = grid(*TINY, 1)
    middle = written_sizes[0][len(points) // 2]
    as_number = load_config({**BASE, "model": tiny_model, "target": {"bytes": middle}}).grid()
    assert as_number == load_config({**BASE, "model": tiny_model, "target": {"bytes": f"{middle}B"}}).grid()
    assert as_number[0]["sparsity"] == points[len(points) // 2]


@pytest.mark.parametrize("size, problem", [(True, "valid integer"), (0, "positive size"), (-3, "not a size"), (2.5, "valid")])
def test_a_memory_target_refuses_what_is_not_a_size_in_one_line(size, problem):
    from evoesap.pipeline.config import load_config

    with pytest.raises(ConfigError, match=f"target.bytes.*{problem}") as refused:
        load_config({**BASE, "target": {"bytes": size}})
    assert "\n" not in str(refused.value)


def test_the_line_says_what_was_probed_and_never_claims_the_unprobed_grid():
    points = grid(N, K, 1)
    search, _ = _fake_search(lambda s: 1 - s)
    record = find(0.75, points, search, N, K, 1, "reap", warm=False, rechecks=1)
    probed = {p.sparsity for p in record.probes}
    above = [s for s in points if s > record.chosen]
    assert above and any(s not in probed for s in above)  # bisection left points above the answer unsearched
    line = record.line()
    assert "largest on the grid" not in line
    assert f"the largest of {len(probed)} of the grid's {len(points)} points probed" in line
    assert f"the next point up, {above[0]:.4f}, misses ({1 - above[0]:.4f} +/- 0.0020)" in line
    assert f"{sum(s not in probed for s in above)} point(s) above {record.chosen:.4f} not probed" in line
    assert "within the noise" not in line  # 0.75 lies 5 standard errors or more from every probe
    top = find(0.01, points, _fake_search(lambda s: 1 - s)[0], N, K, 1, "reap", warm=False, rechecks=1)
    assert top.chosen == points[-1] and "the grid's last point" in top.line() and "not probed" not in top.line()


@pytest.mark.parametrize("threshold", [0.74, 0.51])
def test_an_answer_within_the_noise_of_the_threshold_says_so_and_what_would_decide_it(threshold):
    points = grid(N, K, 1)
    stderr = 0.03  # a point's neighbours differ by 1/28 of ESAP here: about one standard error
    search, _ = _fake_search(lambda s: 1 - s, stderr)
    record = find(threshold, points, search, N, K, 1, "reap", warm=False, rechecks=1)
    chosen = record.chosen
    above = points[points.index(chosen) + 1]
    line = record.line()
    deciding = [(s, 1 - s) for s in (chosen, above) if abs(1 - s - threshold) <= 2 * stderr]
    assert deciding  # the boundary between grid points falls inside the noise
    assert "; within the noise: " in line
    for sparsity, value in deciding:  # each such probe named, with the samples that would separate it (stderr ~ 1/sqrt(n))
        need = max(9, math.ceil(8 * (2 * stderr / abs(value - threshold)) ** 2))
        assert f"{sparsity:.4f}'s {value:.4f} +/- {stderr:.4f} is within 2 standard errors of {threshold}" in line
        assert f"about {need} held-out samples (now 8) would decide it" in line
    quiet, _ = _fake_search(lambda s: 1 - s, 1e-5)
    assert "within the noise" not in find(threshold, points, quiet, N, K, 1, "reap", warm=False, rechecks=1).line()


def test_an_unmet_target_within_the_noise_says_so():
    points = grid(N, K, 1)
    search, _ = _fake_search(lambda s: 0.9 - s, 0.01)  # the lowest point reaches 0.9 - 1/28, 1.6 standard errors short
    record = find(0.88, points, search, N, K, 1, "reap", warm=False, rechecks=1)
    assert record.chosen is None
    line = record.line()
    assert line.startswith("no probed sparsity meets heldout_esap >= 0.88 (the lowest sparsity tried, ")
    assert f"{len(record.probes)} of the grid's {len(points)} points probed" in line
    assert f"{points[0]:.4f}'s {0.9 - points[0]:.4f} +/- 0.0100 is within 2 standard errors of 0.88" in line


def _decided(chosen: dict) -> list:
    """(target URI, TargetRecord) per criterion, as `decide` returns them: `chosen` criterion -> sparsity or None."""
    from evoesap import records

    probe = records.Probe(
        sparsity=0.25, budget=8, search="/s", removal_counts=(8,), fitness=0.9, heldout=0.9, stderr=None, meets=False
    )
    made = lambda c, s: records.TargetRecord(  # noqa: E731
        criterion=c, metric="heldout_esap", threshold=0.95, grid=(0.25, 0.5), max_probes=2, probes=(probe,), chosen=s,
        chosen_search=None if s is None else "/s",
    )  # fmt: skip
    return [(f"/store/target/{c}", made(c, s)) for c, s in chosen.items()]


def _find(tmp_path, monkeypatch, chosen: dict):
    """The finder task's function on stub inputs, `decide` answering `chosen`; (its points, its decisions artifact)."""
    from evoesap.components.target import find_sparsities
    from kfp import dsl

    monkeypatch.setattr("evoesap.pipeline.target.decide", lambda *args: _decided(chosen))
    ours = lambda name: dsl.Dataset(name=name, uri=f"kfp://{name}", metadata={"stage": "x", "uri": f"/store/{name}"})  # noqa: E731
    tmp_path.mkdir(parents=True, exist_ok=True)  # KFP makes an output's folder
    decisions = dsl.Artifact(name="decisions", uri=str(tmp_path / "decisions"), metadata={})
    points = find_sparsities(
        model=ours("model"), scores=ours("scores"), cache=ours("cache"), heldout_cache=ours("heldout"),
        storage_root="/store", criteria=list(chosen), target={"heldout_esap": 0.95}, decisions=decisions,
    )  # fmt: skip
    return points, decisions


def test_a_criterion_that_misses_the_target_reaches_the_report_and_the_run_ends_after_it(tmp_path, monkeypatch):
    """The finder hands on the criteria that met the target and names every decision, the missed one's too, for the
    report; the check after the report then ends the run with the missed one's reason."""
    from evoesap.components.target import check_targets

    points, decisions = _find(tmp_path, monkeypatch, {"reap": 0.5, "frequency": None})
    assert points == [{"criterion": "reap", "sparsity": 0.5}]
    assert decisions.metadata["targets"] == {"reap": "/store/target/reap", "frequency": "/store/target/frequency"}
    with pytest.raises(ConfigError, match=r"^frequency: no probed sparsity meets heldout_esap >= 0.95") as ended:
        check_targets(decisions=decisions)
    assert "reap" not in str(ended.value) and "\n" not in str(ended.value)


def test_when_no_criterion_meets_the_target_the_run_ends_at_the_finder_and_all_met_passes_the_check(tmp_path, monkeypatch):
    from evoesap.components.target import check_targets

    with pytest.raises(ConfigError, match="reap: no probed sparsity meets"):  # nothing to fan out over
        _find(tmp_path / "a", monkeypatch, {"reap": None})
    points, decisions = _find(tmp_path / "b", monkeypatch, {"reap": 0.25, "frequency": 0.5})
    assert [p["sparsity"] for p in points] == [0.25, 0.5]
    assert check_targets(decisions=decisions) is None
