"""The CPU numerics the demo world trains with, pinned so that every x86-64 machine trains the same weights.

Unpinned, torch picks its vector kernels (ATen) and MKL picks its SGEMM code for the CPU at hand, and each
rounds differently: a 20-step training gave one digest with AVX-512 and another with AVX2 (docs/results/demo.md,
"One world on every x86 machine"). Both libraries read their choice from the environment when torch is imported,
so the world trains in a child process started with `pinned_environment()`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)

# Part of the world's key (`evoesap.demo.world.world_key`): another value here is another world.
PINNED_NUMERICS: dict[str, str] = {
    # ATen's vector kernels (elementwise ops, softmax, norms, reductions, AdamW): the AVX2 build, the widest that
    # every x86-64 CPU with AVX2 and FMA (Intel since 2013, AMD since 2015) runs, whatever wider units it has.
    "ATEN_CPU_CAPABILITY": "avx2",
    # MKL's conditional numerical reproducibility: COMPATIBLE is the one code branch MKL documents as giving the
    # same results on Intel and non-Intel CPUs (AVX2 holds for Intel CPUs alone); STRICT whatever the alignment.
    # Training calls MKL for SGEMM only (MKL_VERBOSE=1).
    "MKL_CBWR": "COMPATIBLE,STRICT",
    # oneDNN: training calls none of it today (ONEDNN_VERBOSE=1 prints nothing); capped so a kernel moved there
    # does not bring AVX-512 or AMX rounding back.
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
PINNED_CAPABILITY = "AVX2"  # what torch.backends.cpu.get_cpu_capability() reports when the pin took effect


def pinned_environment(base: Mapping[str, str]) -> dict[str, str]:
    """`base` (a process environment) with the pinned numerics in place of whatever it set for them."""
    return {**base, **PINNED_NUMERICS}


def check_pinned() -> str:
    """The CPU capability torch runs with, in the process that trains; a warning when it is not the pinned one
    (a CPU without AVX2 and FMA, where ATen falls back to its scalar kernels and the weights differ)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability != PINNED_CAPABILITY:
        log.warning(
            "torch runs %s kernels, not the pinned %s (ATEN_CPU_CAPABILITY=%s): this CPU lacks AVX2 or FMA, so the "
            "demo world trained here differs from the recorded one; results will not match docs/results/demo.md",
            capability,
            PINNED_CAPABILITY,
            PINNED_NUMERICS["ATEN_CPU_CAPABILITY"],
        )
    return capability
