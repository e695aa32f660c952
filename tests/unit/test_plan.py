"""evoesap.planning.plan: predictions from config.json alone, the example configs' tables and refusals, the stage check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from evoesap import moe
from evoesap.errors import ResourceError
from evoesap.machine import sizes
from evoesap.planning import footprint, plan

DATA = Path(__file__).parents[1] / "data" / "plan"
GB80 = 80 * 10**9


def test_model_bytes_from_headers_and_from_config_alone_equal_the_loaded_model(tmp_path):
    model = moe.tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path / "full", max_shard_size="50KB")
    (tmp_path / "config-only").mkdir()
    model.config.save_pretrained(tmp_path / "config-only")
    want = moe.parameter_bytes(model)
    assert footprint.model_shape(str(tmp_path / "full")).bytes == want
    assert footprint.model_shape(str(tmp_path / "config-only")).bytes == want
    assert footprint.model_shape(str(tmp_path / "full"), "bfloat16").bytes == want // 2
    assert footprint.model_shape(str(tmp_path / "full")).expert_bytes == sum(
        n * b for n, b in zip(moe.inspect(model).num_experts, moe.expert_bytes(model))
    )


def test_pruned_checkpoint_bytes_come_from_its_files(tmp_path):
    model = moe.tiny_model("olmoe")
    model.save_pretrained(tmp_path / "full")
    moe.prune_checkpoint(str(tmp_path / "full"), {0: [1, 2, 3], 2: [0]}, tmp_path / "pruned")
    assert footprint.model_shape(str(tmp_path / "pruned")).bytes == moe.parameter_bytes(moe.load_pruned(str(tmp_path / "pruned")))


def test_cache_bytes_match_a_loaded_cache(tmp_path):
    from evoesap.data import TokenizedSample
    from evoesap.scoring import teacher

    model = moe.tiny_model("olmoe", vocab_size=300)
    samples = [TokenizedSample(i, list(range(3, 40)), [False] * 5 + [True] * 32) for i in range(3)]
    for mode in ("full", "topk"):
        meta = teacher.write_cache(model, samples, tmp_path / mode, mode=mode, top_k=16)
        cache = teacher.load_cache(str(tmp_path / mode))
        light = footprint.CACHE_ROW_BYTES * meta.num_positions
        tail = 4 * meta.num_positions if mode == "topk" else 0
        assert footprint.cache_bytes(meta.num_positions, 300, mode, 16, "float16") == cache.heavy_bytes + light + tail


def example(name: str, gpus: int) -> tuple[footprint.ModelShape, footprint.Data, dict, list[footprint.StagePlan]]:
    from evoesap.pipeline.config import load_config

    config = load_config(DATA / f"{name}.yaml")
    return plan.pipeline_plan(config, footprint.Machine(256 * 10**9, GB80, gpus))


def test_olmoe_fits_one_80gb_gpu_with_the_full_cache():
    shape, data, params, plans = example("olmoe", 1)
    assert shape.bytes == 13_838_323_712  # 6.92B parameters in bfloat16
    assert params["cache-logits"].mode == "full"
    assert footprint.cache_bytes(data.cache_rows, shape.vocab, "full", 64, "float16") / 2**30 == pytest.approx(24.6, abs=0.1)
    assert [p.refusal for p in plans] == [None] * 5


def test_qwen3_defaults_to_topk_and_one_gpu_refuses_evaluate_naming_the_settings():
    shape, data, params, plans = example("qwen3", 1)
    assert shape.bytes == 61_064_245_248  # 30.5B parameters in bfloat16
    assert params["cache-logits"].mode == "topk"  # the full cache (74 GiB) would not leave the search room
    refused = {p.stage: p.refusal for p in plans if p.refusal}
    assert list(refused) == ["evaluate"]
    assert "evaluate.batch_size" in refused["evaluate"] and "device_map" in refused["evaluate"]


def test_qwen3_over_two_gpus_fits_every_stage():
    _, _, _, plans = example("qwen3-2gpu", 2)
    assert [p.refusal for p in plans] == [None] * 5
    one = {p.stage: p.device for p in example("qwen3", 1)[3]}
    assert all(p.device < one[p.stage] for p in plans if p.device)


def test_the_full_qwen3_cache_is_refused_for_the_search_naming_topk():
    _, data, params, _ = example("qwen3", 1)
    shape = footprint.model_shape(str(DATA / "qwen3-30b-a3b"), "bfloat16")
    import dataclasses

    params["cache-logits"] = dataclasses.replace(params["cache-logits"], mode="full")
    small_host = footprint.Machine(64 * 10**9, GB80, 1)
    search = footprint.plan_stages(shape, small_host, data, params, only="search")[0]
    assert search.refusal is not None and "cache_logits.mode: topk" in search.refusal


def test_a_stage_that_would_not_fit_is_refused_before_any_work(tmp_path, monkeypatch):
    from evoesap.stages.calibrate import CalibrateParams
    from evoesap.steps import run_stage

    moe.tiny_model("olmoe").save_pretrained(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "two words"}\n' * 2)
    monkeypatch.setattr(footprint, "local_machine", lambda device="auto": footprint.Machine(host=1 << 20))
    with pytest.raises(ResourceError, match="calibrate needs .* available: change calibrate.batch_size"):
        run_stage(
            "calibrate", {"model": str(tmp_path / "model"), "data": str(data)}, CalibrateParams(samples=2), str(tmp_path / "out")
        )
    assert not (tmp_path / "out").exists()


def test_parse_bytes_reads_kubernetes_sizes():
    assert sizes.parse_bytes("80GB") == 80 * 10**9
    assert sizes.parse_bytes("64Gi") == 64 << 30
    assert sizes.parse_bytes("512M") == 512 * 10**6
    with pytest.raises(Exception, match="not a size"):
        sizes.parse_bytes("lots")


def _cache_logits_case(tmp_path):
    """A tiny model and data, a cache-logits setting, and a host that holds a top-K search but not a full one."""
    import dataclasses

    from tiny_world import make_tiny_inputs

    from evoesap.machine import runtime
    from evoesap.stages.cache_logits import CacheLogitsParams
    from evoesap.stages.search import SearchParams

    files = make_tiny_inputs(tmp_path)
    params = CacheLogitsParams(top_k=8, samples=12, max_length=128, batch_size=1, device="cpu")
    rows = sum(len(s.input_ids) for s in runtime.tokenized_samples(files["model"], files["search"], params)[1])
    shape = footprint.model_shape(files["model"])

    def search_host(mode: str) -> int:
        # without the prefix cache, which takes half of whatever the rest leaves and so never tips the balance
        params_by_stage = {"cache-logits": dataclasses.replace(params, mode=mode), "search": SearchParams(prefix_reuse=False)}
        return footprint.plan_stages(shape, footprint.Machine(1 << 50), footprint.Data(0, rows), params_by_stage, only="search")[
            0
        ].host

    full, topk = search_host("full"), search_host("topk")
    # the two searches differ by the two caches' sizes, as cache_bytes gives them
    assert (
        full - topk
        == rows * ((shape.vocab - 8) * 2 - 8 * 4 - 4)
        == (
            footprint.cache_bytes(rows, shape.vocab, "full", 8, "float16")
            - footprint.cache_bytes(rows, shape.vocab, "topk", 8, "float16")
        )
    )
    # refusals leave out the checkpoint's expert pages that stay mapped after loading (the kernel drops them)
    between = (full + topk) // 2 - shape.expert_bytes
    return files, params, footprint.Machine(host=between), footprint.Machine(host=2 * full)


def test_an_unset_cache_mode_is_topk_where_a_search_could_not_hold_the_full_cache(tmp_path, monkeypatch, caplog):
    import json
    import logging

    from evoesap.steps import run_stage

    files, params, small, large = _cache_logits_case(tmp_path)
    assert params.mode is None  # unset by default: the stage chooses
    for machine, want in ((small, "topk"), (large, "full")):
        monkeypatch.setattr(footprint, "local_machine", lambda device="auto", m=machine: m)
        out = tmp_path / want
        with caplog.at_level(logging.INFO, logger="evoesap.planning.footprint"):
            run_stage("cache-logits", {"model": files["model"], "data": files["search"]}, params, str(out))
        assert json.loads((out / "cache.json").read_text())["mode"] == want
        assert json.loads((out / "manifest.json").read_text())["params"]["mode"] is None  # recorded as asked: reusable
    assert "cache mode topk" in caplog.text and "--mode full" in caplog.text and "cache mode full" in caplog.text


def test_an_explicit_full_cache_that_no_search_here_could_hold_is_refused_naming_topk(tmp_path, monkeypatch):
    import dataclasses

    from evoesap.steps import run_stage

    files, params, small, _ = _cache_logits_case(tmp_path)
    monkeypatch.setattr(footprint, "local_machine", lambda device="auto": small)
    with pytest.raises(ResourceError, match="cache_logits.mode is full, but search needs .*cache_logits.mode: topk"):
        run_stage(
            "cache-logits",
            {"model": files["model"], "data": files["search"]},
            dataclasses.replace(params, mode="full"),
            str(tmp_path / "out"),
        )
    assert not (tmp_path / "out").exists()


def test_default_cache_mode_keeps_the_full_cache_within_half_of_the_search_memory():
    from evoesap.stages.cache_logits import CacheLogitsParams
    from evoesap.stages.search import SearchParams

    shape = footprint.model_shape(str(DATA / "olmoe-1b-7b"), "bfloat16")
    data = footprint.Data(0, 64 * 4096)
    full = footprint.cache_bytes(data.cache_rows, shape.vocab, "full", 64, "float16")
    for device, want in ((2 * full, "full"), (2 * full - 1, "topk")):
        mode, why = footprint.default_cache_mode(
            shape, footprint.Machine(1 << 50, device, 1), data, CacheLogitsParams(), SearchParams()
        )
        assert mode == want, why


def test_cpu_host_plan_is_runtime_model_restacked_experts_dense_copies_one_layer_and_head_chunks(tmp_path):
    """The CPU figures, term by term, from the loaded model's own parameters (not the planner's module walk)."""
    from evoesap.scoring import teacher
    from evoesap.steps import make_params

    model = moe.tiny_model("olmoe", vocab_size=500).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    shape = footprint.model_shape(str(tmp_path / "m"), "bfloat16")
    cfg = model.config
    attention = sum(p.numel() * 2 for n, p in model.named_parameters() if ".self_attn." in n and n.endswith("_proj.weight"))
    assert shape.dense_linear_bytes == attention  # OLMoE: q, k, v, o; the router is no nn.Linear, the head is left out
    settings = {"samples": 4, "max_length": 32, "batch_size": 2}
    params = {
        "calibrate": make_params("calibrate", settings),
        "cache-logits": make_params("cache-logits", {**settings, "mode": "full"}),
        "search": make_params("search", {"batch_size": 2}),
        "prune": make_params("prune", {"sparsity": 0.5}),
        "evaluate": make_params("evaluate", {}),
    }
    rows = 100
    host = {
        p.stage: p.host for p in footprint.plan_stages(shape, footprint.Machine(1 << 50), footprint.Data(4 * 32, rows), params)
    }
    base = footprint.RUNTIME_BYTES + moe.parameter_bytes(model) + shape.expert_bytes + attention
    layer = 64 * 2 * (8 * cfg.hidden_size + 3 * cfg.num_experts_per_tok * cfg.intermediate_size)  # 2 x 32 tokens, bf16
    assert host["calibrate"] == base + layer
    full_row = 500 * 2 + footprint.CACHE_ROW_BYTES
    queue = (teacher.WRITE_QUEUE + 2) * 64 * full_row  # the batch's 64 rows fit one head chunk
    assert host["cache-logits"] == base + layer + 64 * 500 * teacher.HEAD_TEMPORARIES * 4 + max(queue, shape.largest_tensor)


def test_gpu_search_plan_counts_the_automatic_prefix_cache_as_half_of_what_the_rest_leaves(tmp_path):
    """On a GPU the search's peak is the CUDA context, the model, one float32-sized layer, the head chunks,
    the cache when it fits, and the prefix cache: its set budget, else half of the device memory left."""
    from evoesap.scoring.evaluator import HEAD_CHUNK_BYTES
    from evoesap.scoring.teacher import HEAD_TEMPORARIES
    from evoesap.steps import make_params

    model = moe.tiny_model("olmoe", vocab_size=500).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    shape = footprint.model_shape(str(tmp_path / "m"), "bfloat16")
    cfg = model.config
    gpu = footprint.Machine(host=1 << 40, device=8 << 30, devices=1)
    cache_p = make_params("cache-logits", {"samples": 4, "max_length": 32, "mode": "topk", "top_k": 8})
    rows = 100
    layer = 4 * 32 * 4 * (2 * 8 * cfg.hidden_size + 3 * cfg.num_experts_per_tok * cfg.intermediate_size)  # batch 4 x 32
    rest = (
        footprint.CUDA_CONTEXT_BYTES
        + moe.parameter_bytes(model)
        + layer
        + HEAD_CHUNK_BYTES["gpu"] * HEAD_TEMPORARIES
        + footprint.cache_bytes(rows, shape.vocab, "topk", 8, "float16")
    )

    def device(machine=gpu, **search) -> int:
        params = {
            "cache-logits": cache_p,
            "search": make_params("search", {"batch_size": 4, **search}),
            "prune": make_params("prune", {"sparsity": 0.5}),
        }
        return footprint.plan_stages(shape, machine, footprint.Data(0, rows), params, only="search")[0].device

    assert device(prefix_reuse=False) == rest
    assert device(prefix_cache_bytes=1 << 20) == rest + (1 << 20)
    useful = 32 * (4 + 1) * cfg.num_hidden_layers * 4 * 32 * cfg.hidden_size * 2  # AUTO_ALLOCATIONS_PER_ELITE x (elites + 1)
    assert useful < (gpu.device - rest) // 2 and device() == rest + useful  # room to spare: what is worth keeping
    tight = footprint.Machine(host=1 << 40, device=rest + useful, devices=1)
    assert device(tight) == rest + useful // 2  # short of room: half of what is left


def test_max_memory_leaves_the_rest_of_the_model_refused_or_offloaded_to_the_host_with_its_cost():
    import dataclasses

    shape, data, params, _ = example("qwen3-2gpu", 2)
    machine = footprint.Machine(256 * 10**9, GB80, 2)
    capped = dataclasses.replace(params["calibrate"], max_memory="20GB")
    spread = footprint.plan_stages(shape, machine, data, params, only="calibrate")[0]
    refused = footprint.plan_stages(shape, machine, data, {**params, "calibrate": capped}, only="calibrate")[0]
    offloaded_p = dataclasses.replace(capped, offload=True)
    offloaded = footprint.plan_stages(shape, machine, data, {**params, "calibrate": offloaded_p}, only="calibrate")[0]

    assert spread.refusal is None and spread.offloaded == 0
    want = shape.bytes - 2 * 20 * 10**9  # what two GPUs of 20 GB leave over
    assert refused.offloaded == offloaded.offloaded == want
    assert "calibrate.offload: true" in refused.refusal and "max_memory 20GB" in refused.refusal
    assert offloaded.refusal is None
    assert offloaded.host == spread.host + want and offloaded.device == spread.device - (shape.bytes // 2 - 20 * 10**9)
    assert f"{want / footprint.OFFLOAD_BYTES_PER_S:.1f} s more per batch" in offloaded.note


def test_a_search_worker_group_spreads_its_replica_over_its_own_gpus():
    import dataclasses

    shape, data, params, _ = example("qwen3-2gpu", 2)
    four = footprint.Machine(256 * 10**9, GB80, 4)
    alone = dataclasses.replace(params["search"], device_map="auto")
    grouped = dataclasses.replace(alone, workers=2, gpus_per_worker=2)
    one_process = footprint.plan_stages(shape, four, data, {**params, "search": alone}, only="search")[0]
    per_group = footprint.plan_stages(shape, four, data, {**params, "search": grouped}, only="search")[0]
    assert per_group.device > one_process.device  # half the GPUs per replica: more of it on each
    two = footprint.plan_stages(shape, footprint.Machine(256 * 10**9, GB80, 2), data, {**params, "search": alone}, only="search")
    assert per_group.device == two[0].device  # a group of 2 of 4 GPUs holds what 2 GPUs alone hold


def test_a_glm4_moe_footprint_counts_its_shared_experts_and_dense_layer_as_dense_and_its_routed_experts_apart(tmp_path):
    model = moe.tiny_model("glm4_moe")  # layer 0 dense (intermediate 128), layers 1-3 MoE: 8 routed of width 32 + 1 shared
    model.config.save_pretrained(tmp_path)
    shape = footprint.model_shape(str(tmp_path))
    hidden, width = model.config.hidden_size, model.config.moe_intermediate_size
    routed = 3 * 8 * (3 * hidden * width + hidden + 1) * 4  # gate/up/down, its router row and selection-bias entry, float32
    assert shape.expert_bytes == routed
    assert (shape.top_k, shape.expert_width) == (2, width)
    shared_and_dense = (3 * 3 * hidden * width + 3 * hidden * model.config.intermediate_size) * 4
    attention = 4 * sum(
        m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".self_attn." in name
    )
    assert shape.dense_linear_bytes == shared_and_dense + attention


def test_a_per_layer_top_k_list_plans_with_its_largest_entry(tmp_path):
    moe.tiny_model("hunyuan_v1_moe", moe_topk=[2, 3, 2, 2]).config.save_pretrained(tmp_path)
    assert footprint.model_shape(str(tmp_path)).top_k == 3
