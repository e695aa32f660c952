"""The modeling file of a non-uniform checkpoint: plain transformers, with no evoesap importable, opens it
(trust_remote_code=True) and gives load_pruned's logits and greedy tokens, for every family and both save paths."""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from moe_support import FAMILIES, cached_model, tokens
from test_moe import UNGROUPED, nonuniform_sets
from transformers import AutoModelForCausalLM

from evoesap import moe
from evoesap.moe.remote_code import MODELING_FILE
from evoesap.store import artifacts

TOL = 1e-6
NEW_TOKENS = 6
# Every family with one expert count per layer drawn at random, plus DeepSeek-V3 routing group-limited
# (4 groups of 4): each layer loses the same number from every group, a different number per layer.
CASES = {family: (UNGROUPED.get(family, {}), None) for family in FAMILIES}
CASES["deepseek_v3-grouped"] = ({}, {0: [0, 4, 8, 12], 1: [1, 2, 5, 6, 9, 10, 13, 14], 2: []})

# Run with `python -I` (no PYTHON* variables, no user site, no script directory on the path) after a
# meta-path finder that refuses evoesap: the checkpoints must open with the venv's torch and transformers alone.
LOADER = r"""
import json, sys

class RefuseEvoESAP:
    def find_spec(self, name, path=None, target=None):
        if name == "evoesap" or name.startswith("evoesap."):
            raise ModuleNotFoundError(f"no module named {name!r} (refused: this must load without evoesap)")
        return None

sys.meta_path.insert(0, RefuseEvoESAP())
try:
    import evoesap
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("evoesap is importable: the isolation failed")

import torch
import transformers

torch.set_num_threads(1)
jobs = json.loads(sys.argv[1])
x = torch.load(jobs["input_ids"])
out = {}
for name, path in jobs["checkpoints"].items():
    auto = getattr(transformers, jobs["auto_class"][name])  # AutoModelForCausalLM; a multimodal model's own class
    model = auto.from_pretrained(path, trust_remote_code=True).eval()
    with torch.no_grad():
        out[f"{name}/logits"] = model(x).logits
        out[f"{name}/generated"] = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=jobs["new_tokens"], do_sample=False
        )
    out[f"{name}/class"] = type(model).__name__
    if name in jobs["resave"]:  # a fine-tuning script saves the model it loaded; the copy opens the same way
        model.save_pretrained(jobs["resave"][name])
        again = auto.from_pretrained(jobs["resave"][name], trust_remote_code=True).eval()
        with torch.no_grad():
            out[f"{name}/resaved_logits"] = again(x).logits
assert not [m for m in sys.modules if m.split(".")[0] == "evoesap"]
torch.save(out, jobs["out"])
"""


def pruned_sets(case: str, model: torch.nn.Module) -> dict[int, list[int]]:
    return CASES[case][1] or nonuniform_sets(moe.inspect(model), seed=len(case))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Per case: the checkpoint written by save_pruned and by the streamed prune, load_pruned's logits and
    greedy tokens; then one isolated subprocess that opens them all with plain transformers."""
    root = tmp_path_factory.mktemp("remote-code")
    x = tokens(seed=5, batch=2, length=12)
    torch.save(x, root / "input_ids.pt")
    want, paths, resave, auto_class = {}, {}, {}, {}
    for case, (overrides, _) in CASES.items():
        family = case.split("-")[0]
        model = cached_model(family, **overrides)
        pruned = pruned_sets(case, model)
        surgery, streamed, full = root / case / "surgery", root / case / "streamed", root / case / "full"
        moe.save_pruned(moe.prune_experts(copy.deepcopy(model), pruned), None, str(surgery))
        model.save_pretrained(full)
        moe.prune_checkpoint(str(full), pruned, streamed)
        reference = moe.load_pruned(str(surgery))
        with torch.no_grad():
            want[case] = {
                "logits": reference(x).logits,
                "generated": reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False),
            }
        paths.update({f"{case}/surgery": str(surgery), f"{case}/streamed": str(streamed)})
        auto_class.update({f"{case}/{name}": moe.FAMILIES[family].auto_class for name in ("surgery", "streamed")})
        resave[f"{case}/surgery"] = str(root / case / "resaved")
    jobs = {
        "input_ids": str(root / "input_ids.pt"),
        "checkpoints": paths,
        "resave": resave,
        "auto_class": auto_class,
        "new_tokens": NEW_TOKENS,
        "out": str(root / "remote.pt"),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(root / "hf-home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-I", "-c", LOADER, json.dumps(jobs)], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {"want": want, "got": torch.load(root / "remote.pt"), "root": root, "x": x}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", ["surgery", "streamed"])
def test_plain_transformers_without_evoesap_gives_load_pruned_logits_and_tokens(checkpoints, case, path):
    got, want = checkpoints["got"], checkpoints["want"][case]
    name = f"{case}/{path}"
    assert got[f"{name}/class"] == moe.NONUNIFORM_ARCHITECTURE_PREFIX + type(cached_model(case.split("-")[0])).__name__
    assert got[f"{name}/logits"].shape == want["logits"].shape
    assert (got[f"{name}/logits"] - want["logits"]).abs().max() <= TOL
    assert torch.equal(got[f"{name}/generated"], want["generated"])
    assert want["generated"].shape[1] > checkpoints["x"].shape[1]  # it really generated


@pytest.mark.parametrize("case", CASES)
def test_a_model_loaded_with_remote_code_saves_a_copy_that_opens_the_same(checkpoints, case):
    got, want = checkpoints["got"], checkpoints["want"][case]
    resaved = checkpoints["root"] / case / "resaved"
    assert (resaved / MODELING_FILE).read_text() == (checkpoints["root"] / case / "surgery" / MODELING_FILE).read_text()
    assert (got[f"{case}/surgery/resaved_logits"] - want["logits"]).abs().max() <= TOL
    assert torch.equal(moe.load_pruned(str(resaved))(checkpoints["x"]).logits, want["logits"])  # and so does ours


@pytest.mark.parametrize("case", CASES)
def test_both_save_paths_write_the_same_modeling_file_named_in_auto_map(checkpoints, case):
    root = checkpoints["root"] / case
    surgery, streamed = root / "surgery", root / "streamed"
    assert (surgery / MODELING_FILE).read_bytes() == (streamed / MODELING_FILE).read_bytes()
    for directory in (surgery, streamed):
        config = json.loads((directory / "config.json").read_text())
        auto_class = moe.FAMILIES[case.split("-")[0]].auto_class
        assert config["auto_map"] == {auto_class: f"modeling_evoesap.{config['architectures'][0]}"}


@pytest.mark.parametrize("family", FAMILIES)
def test_modeling_file_imports_only_torch_transformers_and_typing(family, tmp_path):
    model = cached_model(family, **UNGROUPED.get(family, {}))
    moe.save_pruned(moe.prune_experts(copy.deepcopy(model), nonuniform_sets(moe.inspect(model), seed=3)), None, str(tmp_path))
    tree = ast.parse((tmp_path / MODELING_FILE).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "typing", "torch", "transformers"}, imported
    assert len((tmp_path / MODELING_FILE).read_text().splitlines()) < 150  # small: the stock class does the work


def test_uniform_checkpoints_carry_no_modeling_file_and_pruning_back_to_uniform_drops_it(tmp_path):
    model = copy.deepcopy(cached_model("olmoe"))
    moe.save_pruned(moe.prune_experts(copy.deepcopy(model), {0: [1], 1: [2], 2: [3], 3: [4]}), None, str(tmp_path / "u"))
    assert not (tmp_path / "u" / MODELING_FILE).exists()
    assert "auto_map" not in json.loads((tmp_path / "u" / "config.json").read_text())

    moe.save_pruned(moe.prune_experts(model, {0: [1, 2], 2: [5]}), None, str(tmp_path / "n"))
    reloaded = moe.load_pruned(str(tmp_path / "n"))  # its config now holds the auto_map entry
    moe.save_pruned(moe.prune_experts(reloaded, {1: [0, 1], 2: [0], 3: [6, 7]}), None, str(tmp_path / "back"))
    config = json.loads((tmp_path / "back" / "config.json").read_text())  # 6 experts everywhere
    assert "auto_map" not in config and moe.PER_LAYER_KEY not in config
    assert config["architectures"] == ["OlmoeForCausalLM"] and config["num_experts"] == 6
    assert not (tmp_path / "back" / MODELING_FILE).exists()
    x = tokens(3)
    stock = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), trust_remote_code=True)
    assert type(stock).__module__.startswith("transformers.models.")
    assert torch.equal(stock(x).logits, moe.load_pruned(str(tmp_path / "back"))(x).logits)


def test_prune_stage_lists_the_modeling_file_in_its_manifest(tmp_path):
    from tiny_world import make_tiny_inputs

    from evoesap.stages.calibrate import CalibrateParams, run_calibrate
    from evoesap.stages.prune import PruneParams, run_prune

    files = make_tiny_inputs(tmp_path)  # OLMoE: 4 MoE layers of 8 experts, top-2; 25% is 8 experts
    scores, search, out = (str(tmp_path / name) for name in ("scores", "search", "pruned"))
    run_calibrate(files["model"], files["calibration"], CalibrateParams(samples=4, max_length=128), scores)
    allocation = {
        "criterion": "reap",
        "sparsity": 0.25,
        "granularity": 1,
        "removal_counts": [4, 2, 2, 0],
        "pruned": {"0": [0, 1, 2, 3], "1": [4, 5], "2": [6, 7], "3": []},
    }
    with artifacts.stage_output(search, "search", {}, {"model": files["model"]}) as staging:
        (staging / "allocation.json").write_text(json.dumps(allocation))
    manifest = run_prune(files["model"], scores, PruneParams(criterion="reap", sparsity=0.25), out, allocation=search)
    assert manifest.files[MODELING_FILE] == artifacts.sha256_file(Path(out) / MODELING_FILE)
    assert artifacts.verify(out, "prune").files == manifest.files
    assert moe.inspect(moe.load_pruned(out)).num_experts == (4, 6, 6, 8)
