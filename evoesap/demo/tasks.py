"""lm-eval task YAMLs over the demo's evaluation splits, and a helper that runs them locally.

The prompt is baked into `doc_to_text` from the tokenizer's own chat template, so the tasks need no
`apply_chat_template` flag from the caller (do NOT pass it: the prompt would be templated twice). A
generative task stops on the end-of-turn token, which is also the tokenizer's eos.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml
from transformers import PreTrainedTokenizerBase

from evoesap.errors import ConfigError

log = logging.getLogger(__name__)

TAG = "evoesap_demo"
_SLOT = "\x00"  # a character no template emits, marks where the user message goes


def task_name(domain: str, multiple_choice: bool = False) -> str:
    return f"{TAG}_{domain}_mc" if multiple_choice else f"{TAG}_{domain}"


def prompt_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """`doc_to_text` for lm-eval: the chat template's rendering of one user turn plus generation prompt."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SLOT}], tokenize=False, add_generation_prompt=True)
    prefix, _, suffix = rendered.partition(_SLOT)
    if "{" in prefix + suffix:
        raise ConfigError(f"chat template output {rendered!r} contains braces that lm-eval would read as Jinja")
    return prefix + "{{messages[0].content}}" + suffix


def write_tasks(
    out_dir: Path,
    eval_files: Mapping[str, Path],
    tokenizer: PreTrainedTokenizerBase,
    multiple_choice: Sequence[str] = ("facts",),
    max_gen_toks: int = 64,
) -> dict[str, str]:
    """One generate_until exact-match task per domain plus one multiple_choice task per MC domain.

    Returns task name -> YAML path. Data paths are absolute because lm-eval resolves `data_files`
    against its working directory, not the YAML's. All tasks carry the tag `evoesap_demo`.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    text = prompt_template(tokenizer)
    end = tokenizer.eos_token
    written: dict[str, str] = {}
    for domain, path in sorted(eval_files.items()):
        common = {
            "tag": [TAG],
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(Path(path).resolve())}},
            "test_split": "test",
            "doc_to_text": text,
            "metadata": {"version": 1},
        }
        gen = dict(
            common,
            task=task_name(domain),
            output_type="generate_until",
            doc_to_target="{{messages[1].content}}",
            generation_kwargs={"until": [end], "do_sample": False, "max_gen_toks": max_gen_toks},
            metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        )
        tasks = [gen]
        if domain in multiple_choice:
            tasks.append(
                dict(
                    common,
                    task=task_name(domain, True),
                    output_type="multiple_choice",
                    doc_to_choice="choices",
                    doc_to_target="label",
                    target_delimiter="",
                    metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                )
            )
        for task in tasks:
            target = out_dir / f"{task['task']}.yaml"
            content = yaml.safe_dump(task, sort_keys=False, allow_unicode=True)
            if not target.exists() or target.read_text(encoding="utf-8") != content:
                tmp = target.with_suffix(".yaml.tmp")
                tmp.write_text(content, encoding="utf-8")
                tmp.replace(target)
            written[task["task"]] = str(target)
    return written


def run_tasks(
    model,
    tokenizer: PreTrainedTokenizerBase,
    tasks_dir: Path,
    tasks: Sequence[str],
    limit: int | None = None,
    batch_size: int = 32,
) -> dict[str, float]:
    """Score a model object on demo tasks through lm-eval; returns task -> exact_match or acc."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        num_fewshot=0,
        log_samples=False,
        bootstrap_iters=0,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    scores: dict[str, float] = {}
    for name, metrics in results["results"].items():
        for key in ("exact_match,none", "acc,none"):
            if key in metrics:
                scores[name] = float(metrics[key])
    log.info("lm-eval scores %s", scores)
    return scores
