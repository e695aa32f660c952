"""A tiny random model of one family, with the demo tokenizer, demo math data and a local lm-eval task, and a
small pipeline configuration for it: one criterion, one sparsity, a population of 6 for 2 generations.

    PYTHONPATH=$PWD python benchmarks/family_pipeline.py glm4_moe runs/families/glm4_moe
    python -m evoesap pipeline run runs/families/glm4_moe/pipeline.yaml --log runs/families/glm4_moe/pipeline.log

The numbers it gives are the whole DAG's on a model of that family's layout (a random model: task scores say
that every stage ran, not how well a real model prunes); docs/results/families.md records them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_world import make_tiny_inputs  # noqa: E402


def write_config(family: str, root: Path) -> Path:
    """Inputs under root/inputs and root/pipeline.yaml, whose artifacts go to root/artifacts."""
    files = make_tiny_inputs(root / "inputs", family=family)
    config = {
        "name": f"tiny-{family.replace('_', '-')}",
        "model": files["model"],
        "calibration_data": files["calibration"],
        "search_data": files["search"],
        "heldout_data": files["heldout"],
        "criteria": ["reap"],
        "sparsities": [0.5],
        "storage_root": str(root / "artifacts"),
        "pipeline_root": str(root / "kfp"),
        "calibrate": {"samples": 16, "max_length": 256},
        "cache_logits": {"samples": 12, "max_length": 256, "dtype": "float32"},
        "search": {"population": 6, "elites": 2, "generations": 2, "batch_size": 8},
        "evaluate": {"tasks": [files["tasks"]], "limit": 12, "batch_size": 4},
        "report": {"title": f"Tiny random {family}: calibrate, search and evaluate on demo math"},
    }
    path = root / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", help="a supported model_type (evoesap families)")
    parser.add_argument("out", type=Path, help="a new directory")
    args = parser.parse_args()
    print(write_config(args.family, args.out))


if __name__ == "__main__":
    main()
