"""The demo world: a tiny trained OLMoE with domain-specialised experts, synthetic chat data, local lm-eval tasks."""

from evoesap.demo.domains import DOMAINS, SPLITS
from evoesap.demo.routing import routing_histograms, total_variation
from evoesap.demo.tasks import TAG, run_tasks, write_tasks
from evoesap.demo.world import DemoWorld, build_demo_world, load_demo_world, weights_hash

__all__ = [
    "DOMAINS",
    "SPLITS",
    "TAG",
    "DemoWorld",
    "build_demo_world",
    "load_demo_world",
    "routing_histograms",
    "run_tasks",
    "total_variation",
    "weights_hash",
    "write_tasks",
]
