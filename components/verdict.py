"""The run's last word on the release gate: a task after the report that gathers every point's verdict.

The gate stage itself succeeds whatever it decides (its verdict is an artifact the report and the caller read, and
publish releases only on a passing one). This task returns "pass" when every verdict passed, else "fail": the
(sub-)pipeline's `verdict` output, which a team's pipeline branches on. With the gate's `stop_on_fail` (read at run
time from the `gate_params` input) a failing verdict instead ends the run, with the verdict's one line (the failing
checks and their numbers) as its error, once the report that shows the verdict exists.
"""

# No `from __future__ import annotations` here: kfp reads the real type annotations.
from typing import Callable, List

from kfp import dsl
from kfp.dsl import Artifact, Input


def check_verdicts(verdicts: Input[List[Artifact]], params: dict = {}) -> str:
    """ "pass" when every verdict of the release gate passed, else "fail"; with stop_on_fail, fail instead.

    Args:
        verdicts: The gate stage's verdicts (gate.json), one per criterion x sparsity point.
        params: The gate's parameters (the pipeline's gate_params): stop_on_fail (default true) makes a failing
            verdict end the run with each failing verdict's one line.

    Returns:
        Output: "pass" or "fail".
    """
    from evoesap.components.kfp_artifacts import source

    from evoesap.params import make
    from evoesap.release.gate import outcome
    from evoesap.stages.gate import GateParams

    stop_on_fail = make(GateParams, params, "gate").stop_on_fail
    return outcome([source(v) for v in verdicts], stop_on_fail)


def make_verdict_check(image: str) -> Callable:
    """`check_verdicts` in the stage image (nothing is installed at run time)."""
    return dsl.component(base_image=image, install_kfp_package=False)(check_verdicts)


def read_verdict(verdict: str) -> str:
    """The (sub-)pipeline's `verdict` output as this task's own, for a condition (`dsl.If(task.output == "fail")`).

    Args:
        verdict: The EvoESAP (sub-)pipeline's `verdict` output, "pass" or "fail".

    Returns:
        Output: The same verdict.
    """
    if verdict not in ("pass", "fail"):
        raise ValueError(f"verdict {verdict!r} is neither 'pass' nor 'fail': give the EvoESAP pipeline's verdict output")
    return verdict


def make_verdict_reader(image: str) -> Callable:
    """`read_verdict` in the stage image: a team's pipeline branches on its output, which kfp.local (2.17) resolves in a
    condition where it does not resolve a sub-pipeline's named output (a cluster resolves both)."""
    return dsl.component(base_image=image, install_kfp_package=False)(read_verdict)


def outcome(uri: str) -> str:
    """The gate component's return, read off its verdict at `uri`: "pass" or "fail", for a condition on it."""
    from evoesap import records

    return "pass" if records.read(uri, records.GateRecord).passed else "fail"
