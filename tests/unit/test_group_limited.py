"""Group-limited routing (DeepSeek-V3 with n_group > 1): orders, removal counts and the stages keep every
group losing the same number of experts, so searched and uniform allocations can be masked and pruned."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evoesap.method import allocation as alloc
from evoesap.store import artifacts
from evoesap import moe
from evoesap.scoring.importance import CRITERIA, model_orders
from moe_support import cached_model, tokens
from tiny_world import make_tiny_inputs

GROUPED = moe.LayerSpec(
    ordinal=0,
    decoder_index=0,
    num_experts=16,
    top_k=2,
    routing="sigmoid_group_topk",
    shared_experts=True,
    n_group=4,
    topk_group=2,
)


@settings(max_examples=50, deadline=None)
@given(st.permutations(range(16)))
def test_every_group_sized_prefix_of_an_admissible_order_takes_one_expert_per_group(order):
    admissible = moe.admissible_order(order, GROUPED)
    assert sorted(admissible) == list(range(16))
    for m in range(1, 5):
        groups = [e // 4 for e in admissible[: 4 * m]]
        assert all(groups.count(g) == m for g in range(4))
    for g in range(4):  # within a group, the criterion's order is kept
        assert [e for e in admissible if e // 4 == g] == [e for e in order if e // 4 == g]
    first_round = admissible[:4]  # the least important expert of each group, least important first
    assert first_round == sorted(first_round, key=list(order).index)


def test_orders_of_layers_without_groups_are_unchanged():
    plain = moe.LayerSpec(ordinal=0, decoder_index=0, num_experts=8, top_k=2, routing="softmax_topk", shared_experts=False)
    assert moe.admissible_order([3, 1, 2, 0, 7, 6, 5, 4], plain) == [3, 1, 2, 0, 7, 6, 5, 4]


@pytest.mark.parametrize(
    "family, overrides, granularity, min_kept, expected_granularity",
    [
        ("deepseek_v3", {}, 1, 8, 4),  # 4 groups of 4, topk_group 2: each group keeps 2 (its best two score it)
        ("deepseek_v3", {}, 2, 8, 4),
        ("deepseek_v3", {}, 8, 8, 8),
        ("deepseek_v3", {"n_group": 1, "topk_group": 1}, 1, 2, 1),
        ("olmoe", {}, 2, 2, 2),
        ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}, 1, 8, 1),  # prune none
    ],
)
def test_pruning_space_raises_granularity_and_floors_for_group_limited_layers(
    family, overrides, granularity, min_kept, expected_granularity
):
    spec = moe.inspect(cached_model(family, **overrides))
    space = moe.pruning_space(spec, granularity)
    assert space.num_experts == spec.num_experts
    assert set(space.min_kept) == {min_kept}
    assert space.granularity == expected_granularity


def test_every_feasible_allocation_of_the_space_masks_like_removal():
    model = cached_model("deepseek_v3")
    spec = moe.inspect(model)
    rng = np.random.default_rng(0)
    scores = pd.DataFrame(
        [
            {
                "layer": layer,
                "expert": e,
                "tokens": 1,
                "frequency": int(rng.integers(100)),
                **{c: float(rng.random()) for c in CRITERIA if c != "frequency"},
            }
            for layer in range(len(spec.layers))
            for e in range(16)
        ]
    )
    orders = model_orders(scores, "reap", spec)
    space = moe.pruning_space(spec)
    budget = alloc.budget(0.25, space.num_experts, space.min_kept, space.granularity)
    feasible = alloc.FeasibleSet(space.num_experts, space.min_kept, budget, space.granularity)
    assert feasible.size > 1
    for index in range(feasible.size):
        moe.check_pruned(spec, alloc.pruned_sets(feasible.unrank(index), orders))  # raises if a group loses more
    pruned = alloc.pruned_sets(feasible.unrank(feasible.size - 1), orders)
    x = tokens(0, batch=1, length=12)
    with torch.inference_mode():
        with moe.masked(model, pruned):
            masked_logits = model(input_ids=x).logits
        removed = moe.prune_experts(copy.deepcopy(model), pruned)
        assert (masked_logits - removed(input_ids=x).logits).abs().max() <= 1e-5


def test_search_and_prune_stages_run_on_group_limited_routing(tmp_path):
    from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
    from evoesap.stages.calibrate import CalibrateParams, run_calibrate
    from evoesap.stages.prune import PruneParams, run_prune
    from evoesap.stages.search import SearchParams, run_search

    files = make_tiny_inputs(tmp_path, family="deepseek_v3")
    scores, cache = str(tmp_path / "scores"), str(tmp_path / "cache")
    run_calibrate(files["model"], files["calibration"], CalibrateParams(samples=8, max_length=256), scores)
    run_cache_logits(files["model"], files["search"], CacheLogitsParams(samples=8, max_length=256, dtype="float32"), cache)
    searched = str(tmp_path / "search")
    run_search(
        files["model"],
        scores,
        cache,
        SearchParams(criterion="reap", sparsity=0.25, population=6, elites=2, generations=2, heldout_fraction=0.25),
        searched,
    )
    document = artifacts.read_json(artifacts.join(searched, "allocation.json"))
    assert document["granularity"] == 4 and document["min_kept"] == [8, 8, 8]
    assert all(count % 4 == 0 for count in document["removal_counts"])
    for layer, ids in document["pruned"].items():
        assert sorted(e // 4 for e in ids) == sorted(list(range(4)) * (len(ids) // 4))
    for allocation in (searched, None):
        out = str(tmp_path / f"pruned-{allocation is None}")
        run_prune(files["model"], scores, PruneParams(criterion="reap", sparsity=0.25), out, allocation=allocation)
        counts = moe.inspect(moe.load_pruned(out)).num_experts
        assert sum(16 - c for c in counts) == document["budget"]
