"""A team's release pipeline with EvoESAP as one of its steps: train -> EvoESAP -> release notes.

`train` stands for the team's own training step: it fine-tunes a checkpoint for a few steps on chat
samples and emits an `Output[dsl.Model]`. EvoESAP takes that model as its input artifact (the whole DAG
as a sub-pipeline, `build_subpipeline`) and hands back the searched pruned model of every
criterion x sparsity point as `dsl.Model` artifacts whose URI is the stored checkpoint (and their metrics).
`release_notes` (named apart from EvoESAP's own `publish` step) receives them and writes release notes from
each checkpoint's own record at `model.path` (expert counts, parameter bytes), its scores and its URI, checked
against the checkpoint's config.

Run it on this machine (kfp.local), on the demo world:

    python -m evoesap pipeline demo --out runs/demo        # once: builds runs/demo/world
    python examples/team_pipeline.py examples/demo.yaml --train-data runs/demo/world/data/code/calibration.jsonl

or compile it for a cluster with `--compile team.yaml`.
"""

# No `from __future__ import annotations`: kfp reads the real type annotations.
import argparse
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from evoesap.pipeline.config import PipelineConfig, load_config
from evoesap.pipeline.dag import build_subpipeline, workspace_config
from kfp import compiler, dsl
from kfp.dsl import Input, Markdown, Metrics, Model, Output


def train(base_model: str, data: str, steps: int, learning_rate: float, model: Output[Model]):
    """Fine-tune `base_model` for `steps` AdamW steps on the chat samples in `data`; save a safetensors checkpoint.

    Args:
        base_model: Checkpoint to start from: a path, URI or hub name.
        data: Chat samples (JSONL with `messages`): the team's training data.
        steps: Optimizer steps.
        learning_rate: AdamW learning rate.

    Returns:
        model: The trained checkpoint (with its tokenizer); metadata: base_model, steps, final_loss.
    """
    import torch

    from evoesap import moe
    from evoesap.data import batches, load_samples, tokenize_samples

    network = moe.load_pruned(base_model, dtype=torch.float32)
    tokenizer = moe.load_tokenizer(base_model)
    tokenized = tokenize_samples(load_samples(data), tokenizer, max_length=256)
    optimizer = torch.optim.AdamW(network.parameters(), lr=learning_rate)
    generator = torch.Generator().manual_seed(0)
    network.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        order = torch.randperm(len(tokenized), generator=generator)[:8].tolist()
        batch = next(batches([tokenized[i] for i in order], 8, tokenizer.pad_token_id or 0))
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)  # [B, T] long
        loss = network(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    network.save_pretrained(model.path, safe_serialization=True)
    tokenizer.save_pretrained(model.path)
    model.metadata.update({"base_model": base_model, "steps": steps, "final_loss": float(loss)})


def release_notes(
    pruned_models: Input[list[Model]], pruned_metrics: Input[list[Metrics]], report: Input[Markdown], release: Output[Markdown]
):
    """Release notes for the pruned models, from the checkpoints handed over.

    Args:
        pruned_models: EvoESAP's searched pruned models, one per criterion x sparsity.
        pruned_metrics: Their evaluations' scalars (one per task), in the same order.
        report: EvoESAP's report.

    Returns:
        release: One line per model: criterion, sparsity, experts kept per layer, size, checkpoint URI.
    """
    import json
    import os

    from evoesap.records.facts import facts

    lines = ["# Release", ""]
    models = []
    for pruned, scores in zip(pruned_models, pruned_metrics):
        # model.path holds the checkpoint's record and config.json: the whole checkpoint under kfp.local or a shared
        # pipeline root; under an object-store pipeline root a view of its small files, the weights at metadata["uri"]
        meta = facts(pruned.path)
        checkpoint = pruned.metadata.get("uri") or pruned.uri  # where the weights are stored
        counts = list(meta["expert_counts"])
        with open(os.path.join(pruned.path, "config.json")) as f:
            config = json.load(f)  # the checkpoint's own config
        stored = config.get("evoesap_num_experts_per_layer")
        if stored is not None and sorted(stored.values()) != sorted(counts):
            raise ValueError(f"{checkpoint}: recorded expert counts {counts} disagree with its config {stored}")
        lines.append(
            f"- {meta['criterion']} at {meta['sparsity']:.0%}: experts per layer {counts}, "
            f"{meta['parameter_bytes'] / 2**20:.2f} MiB of parameters, scores {dict(scores.metadata)}, checkpoint {checkpoint}"
        )
        models.append({"uri": checkpoint, "expert_counts": counts, "scores": dict(scores.metadata)})
    lines += ["", f"Report: {report.metadata['uri']}"]
    with open(release.path, "w") as f:
        f.write("\n".join(lines) + "\n")
    release.metadata["models"] = models


class Release(NamedTuple):
    release: Markdown
    pruned_models: list[Model]


def build_team_pipeline(config: PipelineConfig) -> Callable:
    """train -> EvoESAP (the configuration's DAG, as a sub-pipeline) -> release notes; the team's steps run in the
    configuration's image too (torch and evoesap are there), so a compiled spec names only its registry."""
    evoesap = build_subpipeline(config)
    step = dsl.component(base_image=config.default_image, install_kfp_package=False)
    train_step, notes_step = step(train), step(release_notes)

    # with `model_workspace` in the configuration, the run's workspace the model is copied into (KFP creates a run's
    # workspace from its root pipeline's config only) and its path for the sub-pipeline; neither without
    workspace = workspace_config(config)
    mounted = {"workspace": dsl.WORKSPACE_PATH_PLACEHOLDER} if workspace is not None else {}

    @dsl.pipeline(
        name=f"{config.name}-team-release",
        description="train -> EvoESAP -> release notes",
        pipeline_config=workspace,
    )
    def team_release(
        train_data: str,
        base_model: str = config.model,
        train_steps: int = 2,
        learning_rate: float = 1e-4,
        storage_root: str = config.storage_root,
    ) -> Release:
        trained = train_step(base_model=base_model, data=train_data, steps=train_steps, learning_rate=learning_rate)
        # Pass at least one parameter with the model: kfp.local 2.17 binds a sub-pipeline's artifact
        # inputs only then (a cluster binds them either way).
        pruned = evoesap(model=trained.outputs["model"], storage_root=storage_root, **mounted)
        notes = notes_step(
            pruned_models=pruned.outputs["pruned_models"],
            pruned_metrics=pruned.outputs["pruned_metrics"],
            report=pruned.outputs["report"],
        )
        return Release(release=notes.outputs["release"], pruned_models=pruned.outputs["pruned_models"])

    return team_release


def main() -> None:
    parser = argparse.ArgumentParser(description="train -> EvoESAP -> release notes, locally (kfp.local) or compiled")
    parser.add_argument("config", type=Path, help="EvoESAP pipeline configuration (e.g. examples/demo.yaml)")
    parser.add_argument("--train-data", required=True, help="JSONL chat samples for the train step")
    parser.add_argument("--compile", type=Path, help="Write the compiled pipeline here instead of running it")
    args = parser.parse_args()
    config = load_config(args.config)
    if args.compile:
        compiler.Compiler().compile(build_team_pipeline(config), str(args.compile))
        print(args.compile)
        return
    from evoesap.pipeline.run import run_local

    outputs = run_local(config, build=build_team_pipeline, arguments={"train_data": str(Path(args.train_data).resolve())})
    print(Path(outputs["release"].path).read_text())


if __name__ == "__main__":
    main()
