"""The demo world: data format and disjointness, tokenizer round trips, caching, determinism, and the
quality bars that make it useful (it has learned its domains, experts specialise, pruning hurts)."""

from __future__ import annotations

import contextlib
import json
import platform
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from evoesap.demo import DOMAINS, SPLITS, build_demo_world, routing_histograms, total_variation, weights_hash
from evoesap.demo.domains import generate_splits, read_jsonl, write_jsonl
from evoesap.demo.tasks import prompt_template, run_tasks
from evoesap.demo.tokenizer import build_tokenizer
from evoesap.demo.train import encode_chat
from evoesap.errors import ConfigError

EVAL_LIMIT = 64  # evaluation samples per task: keeps lm-eval generation to about a minute on 2 cores


# ------------------------------------------------------------------------------------------- fast
@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_splits_are_disjoint_and_deterministic(domain):
    a = generate_splits(domain, seed=3, train_size=300)
    b = generate_splits(domain, seed=3, train_size=300)
    assert [s.to_json() for s in a["evaluation"]] == [s.to_json() for s in b["evaluation"]]
    held_out = [split for split in SPLITS if split != "train"]
    prompts = {split: {s.user for s in a[split]} for split in SPLITS}
    for i, x in enumerate(held_out):
        assert len(prompts[x]) == len(a[x]), f"{domain}/{x} repeats a prompt"
        for y in held_out[i + 1 :]:
            assert not prompts[x] & prompts[y], f"{domain}: {x} and {y} share prompts"
    if DOMAINS[domain].memorised:
        # Facts are learned, so training covers every evaluated fact; nothing else may appear there.
        assert set().union(*(prompts[s] for s in held_out)) == prompts["train"]
    else:
        for x in held_out:
            assert not prompts[x] & prompts["train"], f"{domain}: {x} leaks into train"
    assert generate_splits(domain, seed=4, train_size=10)["evaluation"] != a["evaluation"]


def test_jsonl_is_messages_style(tmp_path):
    samples = generate_splits("facts", seed=0, train_size=10)["evaluation"][:5]
    write_jsonl(samples, tmp_path / "x.jsonl")
    for line in (tmp_path / "x.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"] for m in row["messages"])
        assert row["choices"][row["label"]] == row["messages"][1]["content"]


def test_math_answers_are_worked_and_correct():
    for s in generate_splits("math", seed=0, train_size=10)["evaluation"]:
        nums = [int(t) for t in re.findall(r"\d+", s.user)]
        assert s.assistant.endswith(f"The answer is {nums[0] + nums[1] - nums[2]}.")
        assert len(build_tokenizer()(s.assistant)["input_ids"]) >= 25  # tens of tokens: ESAP must not saturate


def test_bracket_verdicts_are_correct_and_training_sees_both_at_every_length():
    """The verdict agrees with an independent check (every prefix opens at least as many as it closes, the
    whole string as many); training holds balanced strings of each length evaluated (it once held 12 in 8,000)."""
    splits = generate_splits("code", seed=0, train_size=3000)
    seen = {}
    for split in ("evaluation", "train"):
        rows = [s for s in splits[split] if s.user.startswith("balanced ")]
        for s in rows:
            brackets = s.user.removeprefix("balanced ")
            prefixes = [brackets[:i].count("(") - brackets[:i].count(")") for i in range(1, len(brackets) + 1)]
            assert s.assistant == ("yes" if min(prefixes) >= 0 and prefixes[-1] == 0 else "no"), s
        seen[split] = {(len(s.user) - len("balanced "), s.assistant) for s in rows}
        assert 0.2 <= sum(s.assistant == "yes" for s in rows) / len(rows) <= 0.7, split
    assert (
        {n for n, _ in seen["evaluation"]}
        <= {n for n, v in seen["train"] if v == "yes"}
        == {n for n, v in seen["train"] if v == "no"}
    )


def test_tokenizer_round_trips_and_masks_assistant(tmp_path):
    build_tokenizer().save_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    chat = generate_splits("code", seed=0, train_size=10)["evaluation"][0].to_json()["messages"]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text == f"<|user|>{chat[0]['content']}<|end|><|assistant|>{chat[1]['content']}<|end|>"
    ids, mask = encode_chat(tok, chat)
    assert tok.decode(ids, skip_special_tokens=False) == text
    # The masked tokens are exactly the assistant's content plus its end-of-turn (what generation must emit).
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == chat[1]["content"] + "<|end|>"
    assert tok.eos_token == "<|end|>" and tok.pad_token_id is not None
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>")


def test_training_mask_equals_the_scored_answer_of_evoesap_data():
    """The demo learns exactly the tokens the search scores (content + end of turn), in every domain."""
    from evoesap.data import Sample, encode_sample

    tok = build_tokenizer()
    for domain in ("code", "copy", "facts", "math"):
        for row in generate_splits(domain, seed=1, train_size=10)["evaluation"][:8]:
            messages = row.to_json()["messages"]
            sample = Sample(id=0, messages=tuple((m["role"], m["content"]) for m in messages))
            assert encode_chat(tok, messages) == encode_sample(sample, tok), domain


def test_task_prompt_matches_chat_template():
    tok = build_tokenizer()
    chat = [{"role": "user", "content": "reverse abcd"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt_template(tok).replace("{{messages[0].content}}", "reverse abcd") == rendered


def test_unknown_profile_and_foreign_directory_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="profile"):
        build_demo_world(tmp_path / "w", profile="huge")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("not a demo world")
    with pytest.raises(ConfigError, match="not a demo world"):
        build_demo_world(tmp_path / "other", profile="quick")


# ------------------------------------------------------------------------------------------- builds
def test_same_seed_gives_identical_weights_whatever_the_callers_threads_and_second_call_is_cached(tmp_path):
    """Two independent quick-profile builds (the default takes minutes), the second from a process set to two
    torch threads, hash equal (training fixes its own thread count); a rebuild is skipped."""
    a = build_demo_world(tmp_path / "a", seed=1, profile="quick")
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if threads != 2 else 1)
    try:
        b = build_demo_world(tmp_path / "b", seed=1, profile="quick")
    finally:
        torch.set_num_threads(threads)
    assert weights_hash(a.model_dir) == weights_hash(b.model_dir) == a.info["weights_sha256"]
    for domain in DOMAINS:
        assert a.data_file(domain, "search").read_bytes() == b.data_file(domain, "search").read_bytes()
    stamp = (a.model_dir / "model.safetensors").stat().st_mtime_ns
    again = build_demo_world(tmp_path / "a", seed=1, profile="quick")
    assert again.key == a.key and (a.model_dir / "model.safetensors").stat().st_mtime_ns == stamp
    other = build_demo_world(tmp_path / "c", seed=2, profile="quick")
    assert other.key != a.key and weights_hash(other.model_dir) != weights_hash(a.model_dir)


def _has_avx2_and_fma() -> bool:
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return {"avx2", "fma"} <= set(flags.split())


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not Path("/proc/cpuinfo").exists() or not _has_avx2_and_fma(),
    reason="the pinned numerics give the recorded weights on x86-64 CPUs with AVX2 and FMA",
)
def test_quick_world_trains_the_recorded_weights_whatever_numerics_the_caller_asks_for(tmp_path, monkeypatch):
    """The recorded digest was trained on an AVX-512/AMX CPU with the pin; unpinned, that CPU trains another
    (benchmarks/world_numerics.py). The caller's own choices (scalar kernels, MKL's AVX-512 branch) are overridden."""
    from evoesap.demo.numerics import PINNED_CAPABILITY, PINNED_NUMERICS
    from evoesap.demo.recorded import recorded_world

    for name, value in {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}.items():
        monkeypatch.setenv(name, value)
    world = build_demo_world(tmp_path / "w", seed=0, profile="quick")
    recorded = recorded_world("quick", 0)
    assert world.info["numerics"] == PINNED_NUMERICS and world.info["cpu_capability"] == PINNED_CAPABILITY
    assert world.key == recorded.key
    assert weights_hash(world.model_dir) == world.info["weights_sha256"] == recorded.weights_sha256


def test_recorded_worlds_are_the_ones_the_code_builds():
    """Each recorded world's key is the one the code computes now: an edit that would train another world
    (code, profile, pinned numerics) fails here until its new figures are recorded (evoesap/demo/recorded.py,
    the README's headline, docs/results/demo.md). No training: the key is a hash of the sources."""
    from evoesap.demo import world as world_mod
    from evoesap.demo.recorded import RECORDED_WORLDS

    assert {("quick", 0), ("default", 0)} <= set(RECORDED_WORLDS)
    for (profile, seed), recorded in RECORDED_WORLDS.items():
        assert world_mod.world_key(seed, profile) == recorded.key, (
            f"the {profile} world (seed {seed}) would now be built with key {world_mod.world_key(seed, profile)[:12]}, "
            f"not the recorded {recorded.key[:12]}: rebuild it, then record its key and weights and update the docs"
        )


def test_docs_name_the_recorded_default_world():
    """The README's headline and the demo results page name the world their figures come from."""
    from evoesap.demo.recorded import recorded_world

    recorded = recorded_world("default", 0)
    if recorded is None:
        pytest.skip("no default world recorded yet")
    root = Path(__file__).parents[2]
    for page in ("README.md", "docs/results/demo.md"):
        text = (root / page).read_text(encoding="utf-8")
        assert f"`{recorded.key[:12]}`" in text and f"`{recorded.weights_sha256[:12]}`" in text, page


def test_shipped_weights_are_the_recorded_ones(tmp_path):
    """Every recorded world whose trained weights ship with the package: the file is the recorded weights."""
    from evoesap.demo import world as world_mod
    from evoesap.demo.recorded import RECORDED_WORLDS

    shipped = sorted(world_mod.SHIPPED_WEIGHTS.glob("*.safetensors"))
    assert [p.name for p in shipped] == ["default-seed0.safetensors"]
    for path in shipped:
        profile, seed = path.stem.rsplit("-seed", 1)
        alone = tmp_path / path.stem
        alone.mkdir()
        (alone / "model.safetensors").symlink_to(path)
        assert weights_hash(alone) == RECORDED_WORLDS[(profile, int(seed))].weights_sha256, path.name


def _ship_quick_world(tmp_path, monkeypatch) -> Path:
    """The quick world's trained weights put where shipped weights live (the quick world ships none)."""
    from evoesap.demo import world as world_mod

    trained = build_demo_world(tmp_path / "trained", seed=0, profile="quick")
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    (shelf / "quick-seed0.safetensors").write_bytes((trained.model_dir / "model.safetensors").read_bytes())
    monkeypatch.setattr(world_mod, "SHIPPED_WEIGHTS", shelf)
    monkeypatch.setattr(world_mod, "_build_in_child", lambda *a: pytest.fail("trained although weights ship"))
    return shelf / "quick-seed0.safetensors"


def test_a_recorded_world_with_shipped_weights_builds_without_training(tmp_path, monkeypatch):
    from evoesap.demo.recorded import recorded_world

    _ship_quick_world(tmp_path, monkeypatch)
    world = build_demo_world(tmp_path / "w", seed=0, profile="quick")
    assert world.info["weights_source"] == "shipped"
    assert weights_hash(world.model_dir) == world.info["weights_sha256"] == recorded_world("quick", 0).weights_sha256
    trained = tmp_path / "trained" / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (world.model_dir / name).read_bytes() == (trained / name).read_bytes(), name
    for domain in DOMAINS:
        assert (
            world.data_file(domain, "search").read_bytes()
            == (tmp_path / "trained" / "data" / domain / "search.jsonl").read_bytes()
        )


def test_damaged_shipped_weights_are_refused_and_leave_no_world(tmp_path, monkeypatch):
    from evoesap.errors import ArtifactError

    shipped = _ship_quick_world(tmp_path, monkeypatch)
    data = bytearray(shipped.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor
    shipped.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="damaged: reinstall evoesap"):
        build_demo_world(tmp_path / "w", seed=0, profile="quick")
    assert not (tmp_path / "w").exists() and not list(tmp_path.glob(".w.build-*"))


def test_training_asked_to_reproduce_the_recorded_world_fails_when_it_does_not(tmp_path, monkeypatch):
    """`train=True` (`make demo-world-train`) must reproduce the recorded weights; here the record says otherwise."""
    import dataclasses

    from evoesap.demo import recorded as recorded_mod
    from evoesap.errors import ModelError

    real = recorded_mod.RECORDED_WORLDS[("quick", 0)]
    monkeypatch.setitem(recorded_mod.RECORDED_WORLDS, ("quick", 0), dataclasses.replace(real, weights_sha256="0" * 64))
    with pytest.raises(ModelError, match="training does not reproduce the recorded world"):
        build_demo_world(tmp_path / "w", seed=0, profile="quick", train=True)
    assert not (tmp_path / "w").exists()


def _table_rows(text: str) -> set[tuple[str, ...]]:
    """A markdown page's data rows of benchmark tables (Full or a sparsity), bold and spacing removed."""
    rows = set()
    for line in text.splitlines():
        cells = tuple(c.strip().strip("*") for c in line.strip().strip("|").split("|"))
        if line.startswith("|") and cells[0] in ("Full", "25%", "50%") and len(cells) == 9:
            rows.add(cells)
    return rows


def test_every_headline_row_is_a_row_of_the_recorded_demo_run():
    """The README, the home page and What you get quote rows of the demo results' table of the recorded world,
    number for number; a headline edited alone (or a demo result recorded without it) fails here."""
    root = Path(__file__).parents[2]
    results = (root / "docs/results/demo.md").read_text(encoding="utf-8")
    current = results[results.index("{#current}") : results.index("{#pinned}")]
    recorded = _table_rows(current)
    assert len(recorded) == 13, "the recorded run's benchmark table: the full model and 12 pruned rows"
    for page in ("README.md", "docs/index.md", "docs/getting-started/what-you-get.md"):
        quoted = _table_rows((root / page).read_text(encoding="utf-8"))
        assert quoted and quoted <= recorded, (page, sorted(quoted - recorded))


def test_world_key_changes_with_the_pinned_numerics(monkeypatch):
    from evoesap.demo import numerics
    from evoesap.demo import world as world_mod

    key = world_mod.world_key(0, "quick")
    monkeypatch.setitem(numerics.PINNED_NUMERICS, "ATEN_CPU_CAPABILITY", "default")
    assert world_mod.world_key(0, "quick") != key


def test_cli_build_prints_locations(tmp_path, capsys):
    from evoesap.cli import main

    assert main(["demo", "build", "--out", str(tmp_path / "w"), "--profile", "quick"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "w" / "model") in out and "evoesap_demo_math" in out
    info = json.loads((tmp_path / "w" / "world.json").read_text())
    assert f"world key {info['key'][:12]}, weights sha256 {info['info']['weights_sha256'][:12]}" in out
    assert main(["demo", "build", "--out", str(tmp_path / "w"), "--profile", "nope"]) == 1


# ------------------------------------------------------------------------------ the trained world
def _load(world):
    tok = AutoTokenizer.from_pretrained(str(world.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(world.model_dir)).eval()
    return model, tok


@contextlib.contextmanager
def _experts_removed(model, removed: dict[int, list[int]]):
    """OLMoE routing with some experts gone: softmax over all logits with removed ones at -inf, then top-k.

    Written here independently of evoesap.moe so the demo's claim does not rest on the code it serves.
    """
    handles = []
    for layer_idx, ids in removed.items():
        gate = model.model.layers[layer_idx].mlp.gate
        dead = torch.tensor(ids, dtype=torch.long)

        def hook(module, args, output, dead=dead):
            logits = output[0]  # [T, E]
            masked = logits.float().index_fill(-1, dead, float("-inf"))
            probs = torch.softmax(masked, dim=-1)
            weights, index = torch.topk(probs, module.top_k, dim=-1)  # [T, k]
            if module.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), index

        handles.append(gate.register_forward_hook(hook))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


@pytest.mark.slow
def test_trained_model_solves_every_domain_through_lm_eval(demo_world):
    model, tok = _load(demo_world)
    scores = run_tasks(
        model, tok, demo_world.tasks_dir, list(demo_world.generative_tasks + demo_world.multiple_choice_tasks), limit=EVAL_LIMIT
    )
    print("\nfull model lm-eval:", json.dumps(scores))
    # The weights are the recorded ones on every machine (shipped; training with the pinned numerics reproduces
    # them): code exact match 0.938, math 0.984, every other task 1.000 on these 64 examples (docs/results/demo.md).
    # Evaluation itself runs the CPU's own kernels, hence a bar a little below; an untrained or wrongly masked
    # model scores near 0.
    for task in demo_world.generative_tasks:
        assert scores[task] >= 0.9, f"{task} exact match {scores[task]:.3f} < 0.9"
    for task in demo_world.multiple_choice_tasks:
        assert scores[task] >= 0.9, f"{task} acc {scores[task]:.3f} < 0.9"


@pytest.mark.slow
def test_experts_specialise_by_domain(demo_world):
    model, tok = _load(demo_world)
    hists = {
        d: routing_histograms(model, tok, [r["messages"] for r in read_jsonl(demo_world.data_file(d, "search"))])
        for d in demo_world.domains
    }
    pairs = [(a, b) for i, a in enumerate(demo_world.domains) for b in demo_world.domains[i + 1 :]]
    tv = {f"{a}-{b}": float(total_variation(hists[a], hists[b]).mean()) for a, b in pairs}
    mean_tv = float(np.mean(list(tv.values())))
    print(f"\nrouting TV per domain pair (mean over layers): {json.dumps(tv)}; mean {mean_tv:.3f}")
    assert mean_tv >= 0.2
    # Balanced overall: the aux loss keeps every expert in use on the mixture of domains.
    overall = np.mean(list(hists.values()), axis=0)  # [L, E]
    assert (overall > 0).all()


@pytest.mark.slow
def test_random_half_pruning_hurts_at_least_one_domain(demo_world):
    model, tok = _load(demo_world)
    tasks = list(demo_world.generative_tasks)
    full = run_tasks(model, tok, demo_world.tasks_dir, tasks, limit=EVAL_LIMIT)
    rng = np.random.default_rng(0)
    n_exp = model.config.num_experts
    removed = {layer: sorted(rng.permutation(n_exp)[: n_exp // 2].tolist()) for layer in range(model.config.num_hidden_layers)}
    with _experts_removed(model, removed):
        pruned = run_tasks(model, tok, demo_world.tasks_dir, tasks, limit=EVAL_LIMIT)
    drops = {t: full[t] - pruned[t] for t in tasks}
    print(f"\nrandom 50% pruning: full {json.dumps(full)} pruned {json.dumps(pruned)} drop {json.dumps(drops)}")
    assert max(drops.values()) >= 0.2


def test_masking_hook_matches_plain_routing_when_nothing_removed():
    """The pruning hook itself is exact: removing no expert leaves the logits unchanged."""
    from evoesap.demo.profiles import PROFILES
    from evoesap.demo.train import make_model

    tok = build_tokenizer()
    model = make_model(PROFILES["quick"], tok, seed=0).eval()
    ids = tok("<|user|>copy abc<|end|><|assistant|>abc", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        base = model(ids).logits
        with _experts_removed(model, {0: []}):
            same = model(ids).logits
        with _experts_removed(model, {0: [0, 1]}):
            changed = model(ids).logits
    torch.testing.assert_close(same, base)
    assert not torch.allclose(changed, base)


def test_world_key_changes_with_the_answer_mask_code_only(tmp_path, monkeypatch):
    """An edit to evoesap.data outside encode_sample's reach keeps the world; one inside retrains it."""
    from evoesap.demo import world as world_mod

    source = Path(world_mod._data.__file__).read_text(encoding="utf-8")
    key = world_mod.world_key(0, "default")
    variants = {
        "unrelated": source + "\n\ndef an_unrelated_helper():\n    return 1\n",
        "mask": source.replace("mask = list(content)", "mask = list(content)  # edited", 1),  # in _with_turn_ends
    }
    assert variants["mask"] != source
    keys = {}
    for name, text in variants.items():
        (tmp_path / f"{name}.py").write_text(text, encoding="utf-8")
        monkeypatch.setattr(world_mod._data, "__file__", str(tmp_path / f"{name}.py"))
        keys[name] = world_mod.world_key(0, "default")
    assert keys["unrelated"] == key
    assert keys["mask"] != key
    assert world_mod.world_key(1, "default") != key != world_mod.world_key(0, "quick")


def test_source_closure_follows_names_and_decorators(tmp_path):
    from evoesap.demo.world import source_closure

    module = tmp_path / "m.py"
    base = (
        "import dataclasses\nLIMIT = 3\n\n@dataclasses.dataclass(frozen=True)\nclass Box:\n    n: int\n\n"
        "def a(x):\n    return b(Box(x))\n\ndef b(box):\n    return min(box.n, LIMIT)\n\ndef c():\n    return 0\n"
    )
    module.write_text(base)
    closure = source_closure(module, "a")
    assert all(part in closure for part in ("def a", "def b", "class Box", "LIMIT = 3", "frozen=True"))
    assert "def c" not in closure and "import" not in closure
    for edit, changes in (("return 0", False), ("LIMIT = 3", True), ("frozen=True", True)):
        module.write_text(base.replace(edit, edit.replace("0", "1").replace("3", "4").replace("True", "False")))
        assert (source_closure(module, "a") != closure) == changes, edit
    with pytest.raises(ConfigError, match="defines no"):
        source_closure(module, "nothing_here")


def test_the_deployment_mix_takes_every_domain_in_turn_and_only_their_samples(demo_world):
    from evoesap.demo.world import MIX, MIX_SPLITS

    domains = sorted(DOMAINS)
    for split in MIX_SPLITS:
        by_domain = {d: read_jsonl(demo_world.data_file(d, split)) for d in domains}
        mixed = read_jsonl(demo_world.data_file(MIX, split))
        assert sorted(map(json.dumps, mixed)) == sorted(json.dumps(r) for rows in by_domain.values() for r in rows)
        shortest = min(map(len, by_domain.values()))
        for i, row in enumerate(mixed[: shortest * len(domains)]):  # while every domain has samples left: in turn
            assert row == by_domain[domains[i % len(domains)]][i // len(domains)]
    with pytest.raises(ConfigError, match="'mix' with"):
        demo_world.data_file(MIX, "train")


def _unbuilt_world(key: str = "", info: dict | None = None):
    """A DemoWorld naming runs/demo/world's parts, for configuration tests that build nothing."""
    from evoesap.demo.world import DemoWorld

    root = Path("runs/demo/world")
    return DemoWorld(
        root=root,
        model_dir=root / "model",
        data_dir=root / "data",
        tasks_dir=root / "tasks",
        generative_tasks=(),
        multiple_choice_tasks=(),
        tag="",
        seed=0,
        profile="default",
        key=key,
        info=info or {},
    )


def test_the_demo_example_config_is_the_demo_make_runs(tmp_path):
    import yaml
    from evoesap.pipeline.demo import demo_config

    made = demo_config(_unbuilt_world(), Path("runs/demo")).model_dump(exclude_none=True)
    example = yaml.safe_load((Path(__file__).parents[2] / "examples" / "demo.yaml").read_text())
    assert {k: made[k] for k in example if k not in ("calibrate", "cache_logits", "search", "evaluate")} == {
        k: v for k, v in example.items() if k not in ("calibrate", "cache_logits", "search", "evaluate")
    }


def test_the_demo_report_title_names_the_world_it_ran_on():
    from evoesap.pipeline.demo import demo_config

    world = _unbuilt_world(key="a3" * 32, info={"weights_sha256": "7e" * 32})
    title = demo_config(world, Path("runs/demo")).model_dump(exclude_none=True)["report"]["title"]
    assert title.endswith("(world a3a3a3a3a3a3, weights sha256 7e7e7e7e7e7e)"), title
