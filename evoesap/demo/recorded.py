"""The demo worlds the docs report: for a (profile, seed), the key the code gives and the weights training gave.

With the pinned numerics (`evoesap.demo.numerics`) every x86-64 CPU with AVX2 and FMA trains these weights from this
key; the default world's ship with the package (`evoesap.demo.world.SHIPPED_WEIGHTS`), so building it needs no
training, and `make demo-world-train` checks that training still reproduces them. tests/system/test_demo.py checks that the code still computes each key (so a change that would build another
world updates this file, the README's headline and docs/results/demo.md together) and that the quick world trains
its recorded weights.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecordedWorld:
    key: str  # `evoesap.demo.world.world_key(seed, profile)`
    weights_sha256: str  # `evoesap.demo.world.weights_hash` of the trained model
    torch_version: str  # the libraries it was trained with: versions are recorded, not keyed on
    transformers_version: str


RECORDED_WORLDS: dict[tuple[str, int], RecordedWorld] = {
    ("default", 0): RecordedWorld(  # its weights ship in evoesap/demo/weights/default-seed0.safetensors
        key="a310f3055ad8c1f1a33849775f2a3158978088758e750d4bb8c0c97cd195b36b",
        weights_sha256="8e9e4a2816cdf3678ec51a2dce340b7bb204c690fb0f47207a79d239327fd39c",
        torch_version="2.13.0+cpu",
        transformers_version="5.24.0",
    ),
    ("quick", 0): RecordedWorld(
        key="b5fb50f88f61bf9b329c121b8255a383bc72936b850b061d7150ccbc8754efce",
        weights_sha256="9145acb8aa59b656e8cd8a72832ba4188f185e4c11ad446c663e40da5a9c2e2a",
        torch_version="2.13.0+cpu",
        transformers_version="5.24.0",
    ),
}


def recorded_world(profile: str, seed: int) -> RecordedWorld | None:
    return RECORDED_WORLDS.get((profile, seed))
