"""The quality-memory frontier: which runs it draws, where, and what it marks."""

import dataclasses

from evoesap import records
from evoesap.reporting import frontier


def _run(method, sparsity, esap, stored, model=None, quantized=False, criterion="reap"):
    return records.MetricsRecord(
        schema=1,
        model=model or f"/m/{method}/{sparsity}",
        records=(),
        memory=records.Memory(parameters=1, parameter_bytes=stored * 2, bf16_bytes=stored, checkpoint_bytes=stored),
        experts=records.Experts(family="olmoe", num_experts=(8,), top_k=(2,), decoder_index=(0,)),
        labels=records.Labels(method=method, sparsity=sparsity, criterion=None if method == "full" else criterion),
        heldout_esap=None if esap is None else records.HeldoutEsap(esap=esap, esap_upper=esap, samples=4),
        quantization=records.Quantized(recipe="fp8-dynamic", scheme="FP8") if quantized else None,
    )


RUNS = [
    _run("full", None, 1.0, 1000),
    _run("searched", 0.5, 0.90, 600, model="/m/candidate"),
    _run("searched", 0.25, 0.97, 800),
    _run("uniform", 0.25, 0.95, 800),
    _run("uniform", 0.5, None, 600),  # no held-out ESAP: not drawn
    _run("searched", 0.5, 0.89, 300, quantized=True),  # a quantized row is not a point of the pruning frontier
    _run("searched", 0.25, 0.93, 800, criterion="frequency"),  # another criterion: its own line
]


def test_points_are_the_pruned_runs_with_heldout_esap_by_criterion_and_bytes():
    assert frontier.points(RUNS) == {
        ("searched", "frequency"): [(800, 0.93, 0.25)],
        ("searched", "reap"): [(600, 0.90, 0.5), (800, 0.97, 0.25)],
        ("uniform", "reap"): [(800, 0.95, 0.25)],
    }
    assert frontier.figure([RUNS[0], RUNS[4]]) is None


def _gate_and_target(value: float, limit: float, threshold: float) -> tuple:
    """A held-out ESAP gate verdict (passed when `value` reaches `limit`) and a reap target choosing 25%."""
    check = records.GateCheck(name="held-out ESAP", value=value, reference=None, limit=limit, passed=value >= limit)
    verdict = records.GateRecord(passed=check.passed, candidate="/m/candidate", checks=(check,))
    target = records.TargetRecord(
        criterion="reap", metric="heldout_esap", threshold=threshold, grid=(0.25, 0.5), max_probes=2, probes=(),
        chosen=0.25, chosen_search="/s/1",
    )  # fmt: skip
    return verdict, target


def test_figure_marks_the_full_model_the_gate_and_the_target():
    verdict, target = _gate_and_target(value=0.90, limit=0.93, threshold=0.96)
    fig = frontier.figure(RUNS, [verdict], [target])
    (ax,) = fig.axes
    labels = ax.get_legend_handles_labels()[1]
    expected = {"searched (reap)", "uniform (reap)", "searched (frequency)", "full", "gate failed", "target (reap)"}
    assert expected | {"gate: least held-out ESAP", "chosen sparsity"} <= set(labels)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["searched (reap)"].get_ydata()) == [0.90, 0.97]  # one line per criterion, not criteria mixed
    assert (
        lines["searched (reap)"].get_color() == lines["uniform (reap)"].get_color() != lines["searched (frequency)"].get_color()
    )
    (chosen,) = [c for c in ax.collections if c.get_label() == "chosen sparsity"]
    assert chosen.get_offsets().tolist() == [[800, 0.97]]  # the target's criterion's searched point at 25%
    horizontal = sorted(
        line.get_ydata()[0] for line in ax.get_lines() if len(set(line.get_ydata())) == 1 and len(line.get_ydata()) == 2
    )
    assert horizontal == [0.93, 0.96]


def _tick_labels_overlap(fig) -> bool:
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in fig.axes[0].get_xticklabels() if t.get_text()]
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def test_size_labels_never_overlap_at_any_scale():
    for full, spread in ((1_066_820, 0.1), (13_803_648, 0.8), (3_000_000_000, 0.05), (27_000_000_000, 0.6)):
        runs = [_run("full", None, 1.0, full)]
        runs += [_run("searched", s, 1 - s / 3, int(full * (1 - s * spread))) for s in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)]
        assert not _tick_labels_overlap(frontier.figure(runs)), full


def test_a_gate_and_a_target_at_the_same_value_both_stay_visible():
    verdict, target = _gate_and_target(value=0.97, limit=0.95, threshold=0.95)
    (ax,) = frontier.figure(RUNS, [verdict], [target]).axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    gate, aim = lines["gate: least held-out ESAP"], lines["target (reap)"]
    assert gate.get_ydata()[0] == aim.get_ydata()[0] == 0.95
    assert gate.get_linestyle() != aim.get_linestyle() and gate.get_color() != aim.get_color()
    assert gate.get_zorder() > aim.get_zorder()  # the gate's dots drawn over the target's dashes
    names = {t.get_text(): t for t in ax.texts}
    assert {"gate 0.95", "target 0.95 (reap)"} <= set(names)  # each line named on the plot, one above, one below
    assert names["gate 0.95"].xyann[1] > 0 > names["target 0.95 (reap)"].xyann[1]


def _pruned(method, sparsity, esap, criterion="reap", full=1_066_820, experts=32):
    """A run of a model with `experts` equal routed experts, `sparsity` of them removed, each weighing 2.5% of it."""
    removed = round((sparsity or 0) * experts)
    run = _run(method, sparsity, esap, int(full * (1 - 0.025 * removed)), criterion=criterion)
    return dataclasses.replace(run, experts=dataclasses.replace(run.experts, num_experts=(experts - removed,)))


def _probe(sparsity, value, meets, experts=32):
    return records.Probe(
        sparsity=sparsity, budget=round(sparsity * experts), search=f"/s/{sparsity}", removal_counts=(round(sparsity * experts),),
        fitness=value, heldout=value, stderr=0.01, meets=meets, samples=8,
    )  # fmt: skip


def _target_run() -> tuple[list, list]:
    """What a target run evaluates: the full model and, per criterion, searched and uniform at the chosen sparsity
    only (reap's two coincide: the search kept uniform), and both decisions at one threshold."""
    runs = [
        _pruned("full", None, 1.0), _pruned("searched", 0.375, 0.93), _pruned("uniform", 0.375, 0.93),
        _pruned("searched", 0.25, 0.95, "frequency"), _pruned("uniform", 0.25, 0.94, "frequency"),
    ]  # fmt: skip
    grid = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)
    reap = records.TargetRecord(
        criterion="reap", metric="heldout_esap", threshold=0.92, grid=grid, max_probes=4, chosen=0.375, chosen_search="/s/a",
        probes=(_probe(0.375, 0.931, True), _probe(0.625, 0.80, False), _probe(0.5, 0.90, False)),
    )  # fmt: skip
    frequency = records.TargetRecord(
        criterion="frequency", metric="heldout_esap", threshold=0.92, grid=grid, max_probes=4, chosen=0.25, chosen_search="/s/b",
        probes=(_probe(0.375, 0.91, False), _probe(0.125, 0.97, True), _probe(0.25, 0.95, True)),
    )  # fmt: skip
    return runs, [reap, frequency]


def test_the_probes_are_marked_at_their_held_out_value_and_size_up_when_met_down_when_missed():
    runs, targets = _target_run()
    (ax,) = frontier.figure(runs, (), targets).axes
    gids = {"probe meets": "^", "probe misses": "v"}
    probes = {tuple(c.get_offsets()[0]): gids[c.get_gid()] for c in ax.collections if c.get_gid() in gids}
    full, per_expert = 1_066_820, 1_066_820 * 0.025  # the runs' own bytes per removed expert
    expected = {
        (full - 12 * per_expert, 0.931): "^", (full - 20 * per_expert, 0.80): "v", (full - 16 * per_expert, 0.90): "v",
        (full - 12 * per_expert, 0.91): "v", (full - 4 * per_expert, 0.97): "^", (full - 8 * per_expert, 0.95): "^",
    }  # fmt: skip
    assert {(round(x), y): m for (x, y), m in probes.items()} == {(round(x), y): m for (x, y), m in expected.items()}
    labels = ax.get_legend_handles_labels()[1]
    assert {"target probe: meets", "target probe: misses", "chosen sparsity", "target (reap, frequency)"} <= set(labels)
    names = {t.get_text() for t in ax.texts}
    assert {"62.5%", "50%", "12.5%"} <= names  # the probes no evaluated point names
    chosen = [tuple(c.get_offsets()[0]) for c in ax.collections if c.get_label() == "chosen sparsity"]
    assert sorted(chosen) == sorted([(runs[1].memory.checkpoint_bytes, 0.93), (runs[3].memory.checkpoint_bytes, 0.95)])


def test_searched_and_uniform_at_one_point_both_stay_visible():
    runs, targets = _target_run()
    (ax,) = frontier.figure(runs, (), targets).axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    searched, uniform = lines["searched (reap)"], lines["uniform (reap)"]
    assert list(searched.get_xydata()[0]) == list(uniform.get_xydata()[0])  # the same point
    assert uniform.get_markerfacecolor() == "none" and uniform.get_markersize() > searched.get_markersize()
    assert searched.get_marker() != uniform.get_marker()
    (chosen,) = [c for c in ax.collections if c.get_label() == "chosen sparsity" and tuple(c.get_offsets()[0]) == (
        runs[1].memory.checkpoint_bytes, 0.93)]  # fmt: skip
    assert chosen.get_facecolor().size == 0 or chosen.get_facecolor()[0][3] == 0  # a ring: the point shows inside it


def test_no_name_on_a_target_runs_frontier_overlaps_another_or_an_axis_label():
    runs, targets = _target_run()
    fig = frontier.figure(runs, (), targets)
    fig.canvas.draw()
    (ax,) = fig.axes
    texts = [t for t in ax.texts if t.get_text()] + [t for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_text()]
    texts += [ax.xaxis.label, ax.yaxis.label]
    boxes = [(t.get_text(), t.get_window_extent()) for t in texts]
    clashes = [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1 :] if box.overlaps(other)]
    assert clashes == []
    assert [t.get_text() for t in ax.texts].count("25%") == 1  # frequency's searched, uniform and chosen probe: named once
