"""Shared fixtures: the trained demo world, built once and cached across test sessions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Every model the tests build is tiny: one intra-op thread, as evoesap.runtime chooses for tiny models
    (two threads spin-wait for each other whenever other processes hold the cores)."""
    from evoesap import runtime

    runtime.use_cpu_threads(parameters=0)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs two workers) every test that needs the demo world goes to one
    worker, first: it trains the world once (single-threaded, minutes) while the other worker runs the rest."""
    def needs_world(item) -> bool:
        return "demo_world" in getattr(item, "fixturenames", ())

    for item in items:
        if needs_world(item):
            item.add_marker(pytest.mark.xdist_group("demo_world"))
    items.sort(key=lambda item: not needs_world(item))  # stable: the rest keep their order


def demo_cache_dir() -> Path:
    """EVOESAP_DEMO_CACHE (when set and not empty), else <repo>/.cache/demo-world (gitignored), so local reruns
    reuse the build."""
    return Path(os.environ.get("EVOESAP_DEMO_CACHE") or REPO / ".cache" / "demo-world")


@pytest.fixture(scope="session")
def demo_world():
    """The default demo world (seed 0); the first session on a machine trains it (minutes), later ones reuse it."""
    from evoesap.demo import build_demo_world

    return build_demo_world(demo_cache_dir(), seed=0, profile="default")


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory):
    """One artifact of every stage from a tiny random OLMoE (tests/tiny_artifacts.py), built once per session."""
    from tiny_artifacts import build

    return build(tmp_path_factory.mktemp("tiny-artifacts"))
