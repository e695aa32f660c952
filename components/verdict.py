"""The run's last word on the release gate: a task after the report that fails the run when a verdict failed.

The gate stage itself succeeds whatever it decides (its verdict is an artifact the report and the caller read, and
publish runs only on a passing one); this task is what makes a failed gate end the run, with the verdict's one line
(the failing checks and their numbers) as its error, once the report that shows the verdict exists.
"""

# No `from __future__ import annotations` here: kfp reads the real type annotations.
from typing import Callable, List

from kfp import dsl
from kfp.dsl import Artifact, Input


def check_verdicts(verdicts: Input[List[Artifact]]):
    """Fail with the failing verdicts' one line each, when any of the release gate's verdicts failed.

    Args:
        verdicts: The gate stage's verdicts (gate.json), one per criterion x sparsity point.
    """
    from evoesap.components.kfp_artifacts import source

    from evoesap.release.gate import raise_on_failed

    raise_on_failed([source(v) for v in verdicts])


def make_verdict_check(image: str) -> Callable:
    """`check_verdicts` in the stage image (nothing is installed at run time)."""
    return dsl.component(base_image=image, install_kfp_package=False)(check_verdicts)


def outcome(uri: str) -> str:
    """The gate component's return, read off its verdict at `uri`: "pass" or "fail", for the pipeline's condition on
    publish."""
    from evoesap import records

    return "pass" if records.read(uri, records.GateRecord).passed else "fail"
