"""The quality-memory frontier: which runs it draws, where, and what it marks."""

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


def test_figure_marks_the_full_model_the_gate_and_the_target():
    check = records.GateCheck(name="held-out ESAP", value=0.90, reference=None, limit=0.93, passed=False)
    verdict = records.GateRecord(passed=False, candidate="/m/candidate", checks=(check,))
    target = records.TargetRecord(
        criterion="reap", metric="heldout_esap", threshold=0.96, grid=(0.25, 0.5), max_probes=2, probes=(), chosen=0.25,
        chosen_search="/s/1",
    )  # fmt: skip
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
