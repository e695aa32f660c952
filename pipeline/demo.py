"""`make demo`: build the demo world and run the whole pipeline on it locally.

A miniature of the paper's setting: calibrate on the code domain, search on the deployment mix (every
domain in turn, the data a general model serves), evaluate every demo domain through lm-eval; REAP and
Frequency at 25% and 50%, uniform beside searched, each searched model also quantized (w4a16-gptq) and evaluated
(its row in the report beside full and pruned). examples/demo-math.yaml is the "specialise" variant
(search on math alone).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from evoesap.pipeline.config import PipelineConfig, load_config
from evoesap.pipeline.run import report_uri, run_local

from evoesap.demo.world import MIX
from evoesap.store import artifacts

log = logging.getLogger(__name__)

# Search and evaluation sized so the whole demo runs in minutes on a 2-core CPU.
DEMO_SEARCH = {"population": 16, "elites": 4, "generations": 12, "batch_size": 16, "heldout_fraction": 0.25}
DEMO_EVALUATE = {"limit": 48, "batch_size": 16}
# Each searched model quantized (4-bit GPTQ on the calibration samples; the demo world's widths are whole groups of
# 128) and evaluated beside it: about 15 s more per point on a 2-core CPU (docs/results/quantization.md).
DEMO_QUANTIZE = {"recipe": "w4a16-gptq", "samples": 64, "max_length": 256}
# What each world profile runs. The quick world (2 layers of 4 experts, top-2, widths of 32) admits a single allocation
# at 50% (nothing to search) and no group of 128 (GPTQ's): it runs 25% only, quantized per channel (fp8-dynamic).
PROFILE_RUNS: dict[str, dict[str, Any]] = {
    "default": {"sparsities": [0.25, 0.5], "quantize": DEMO_QUANTIZE},
    "quick": {"sparsities": [0.25], "quantize": {"recipe": "fp8-dynamic"}},
}


DEMO_TITLE = "EvoESAP demo: OLMoE-tiny, calibrate on code, search on the deployment mix"


def _world_suffix(world: Any) -> str:
    """The world's key and weights digest for the report's title, so the report names the world it ran on
    (docs/results/demo.md records the figures of one world); nothing for a world not yet built."""
    digest = world.info.get("weights_sha256") if world.key else None
    return f" (world {world.key[:12]}, weights sha256 {digest[:12]})" if digest else ""


def demo_config(world: Any, out: Path, runner: str = "subprocess", image: str | None = None) -> PipelineConfig:
    """The pipeline configuration for a built demo world, writing under `out` (with the docker runner,
    kfp's root is `out` itself, so the stage containers see the world and the artifacts)."""
    runs = PROFILE_RUNS[world.profile]
    return load_config(
        {
            "name": "evoesap-demo",
            "model": str(world.model_dir),
            "calibration_data": str(world.data_file("code", "calibration")),
            "search_data": str(world.data_file(MIX, "search")),
            "heldout_data": str(world.data_file(MIX, "search_heldout")),
            "criteria": ["reap", "frequency"],
            "sparsities": runs["sparsities"],
            "storage_root": str(out / "artifacts"),
            "pipeline_root": str(out if runner == "docker" else out / "kfp"),
            **({"image": image} if image else {}),
            "calibrate": {"samples": 64, "max_length": 256, "batch_size": 16},
            "cache_logits": {"samples": 64, "max_length": 256, "batch_size": 16, "dtype": "float32"},
            "search": DEMO_SEARCH,
            "evaluate": {"tasks": [str(world.tasks_dir)], **DEMO_EVALUATE},
            "quantize": runs["quantize"],
            "report": {"title": DEMO_TITLE + _world_suffix(world)},
        }
    )


def run_demo(
    out: Path,
    seed: int = 0,
    profile: str = "default",
    log_path: Path | None = None,
    runner: str = "subprocess",
    image: str | None = None,
) -> str:
    """Build (or reuse) the demo world under `out`, run the pipeline, return the report artifact URI."""
    from evoesap.demo.world import build_demo_world

    if runner == "subprocess":  # the quantize step's environment, before the world trains (minutes)
        from evoesap.release.quantize_env import quantize_python

        quantize_python()

    world = build_demo_world(out / "world", seed=seed, profile=profile)
    config = demo_config(world, out, runner, image)
    config_path = out / "pipeline.yaml"
    import yaml

    config_path.write_text(yaml.safe_dump(config.model_dump(exclude_none=True), sort_keys=False))
    log.info("demo configuration written to %s", config_path)
    return report_uri(run_local(config, log_path=log_path, runner=runner))


def main_table(report_uri: str) -> str:
    """The benchmark table of a report, for printing."""
    text = artifacts.read_bytes(artifacts.join(report_uri, "report.md")).decode("utf-8")
    lines = text.split("## Benchmarks", 1)[-1].splitlines()  # the summary's table comes first
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        return text
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])
