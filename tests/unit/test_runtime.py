"""evoesap.machine.runtime: models load straight onto their device; free memory as the host and its container allow."""

from __future__ import annotations

import pytest
import torch

from evoesap import moe
from evoesap.errors import ConfigError, ResourceError
from evoesap.machine import runtime


class _Loaded(torch.nn.Module):
    def to(self, *args, **kwargs):  # a whole-model move after loading is what load_model must not do
        raise AssertionError("the model was moved after loading")


def test_load_model_places_weights_on_the_device_while_loading(monkeypatch):
    calls = []
    monkeypatch.setattr(moe, "load_pruned", lambda uri, **kwargs: calls.append(kwargs) or _Loaded())
    runtime.load_model("m", "bfloat16", device="cuda:1")
    runtime.load_model("m", device="cpu")
    runtime.load_model("m", device="cuda", device_map="auto")
    monkeypatch.setattr(runtime, "placement_kwargs", lambda *args: {"device_map": "auto", "max_memory": {0: 1, "cpu": 2}})
    runtime.load_model("m", device="cuda", device_map="auto", max_memory="1", offload=True)
    assert calls == [
        {"dtype": torch.bfloat16, "device_map": {"": "cuda:1"}},
        {"dtype": "auto"},
        {"dtype": "auto", "device_map": "auto"},
        {"dtype": "auto", "device_map": "auto", "max_memory": {0: 1, "cpu": 2}},
    ]


def test_a_tiny_checkpoint_loads_on_the_cpu_without_dispatch_hooks_and_on_one_thread(tmp_path, monkeypatch):
    monkeypatch.delenv(runtime.CPU_THREADS_ENV, raising=False)
    moe.tiny_model("olmoe").save_pretrained(tmp_path)
    with _threads(2):
        model = runtime.load_model(str(tmp_path), device="cpu")
        assert torch.get_num_threads() == 1
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert not hasattr(model, "hf_device_map")


class _threads:
    """torch's intra-op thread count set for a block (and runtime's memory of it cleared), restored after."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.saved = torch.get_num_threads(), runtime._threads_before_tiny
        runtime._threads_before_tiny = None
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved[0])
        runtime._threads_before_tiny = self.saved[1]


def test_tiny_models_get_one_thread_and_larger_ones_torchs_own_count(monkeypatch):
    monkeypatch.delenv(runtime.CPU_THREADS_ENV, raising=False)
    assert runtime.cpu_threads(3_000_000) == 1
    assert runtime.cpu_threads(runtime.TINY_MODEL_PARAMETERS) is None
    with _threads(2):
        assert runtime.use_cpu_threads(3_000_000) == 1 == torch.get_num_threads()
        assert runtime.use_cpu_threads(1_000) == 1  # a second tiny model: still 1, the 2 still remembered
        assert runtime.use_cpu_threads(7_000_000_000) == 2 == torch.get_num_threads()  # back to what it was
        torch.set_num_threads(1)  # a caller's own choice for a large model is left alone
        assert runtime.use_cpu_threads(7_000_000_000) == 1


def test_an_explicit_thread_count_wins_over_model_size_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.setenv(runtime.CPU_THREADS_ENV, "2")
    assert runtime.cpu_threads(3_000_000) == runtime.cpu_threads(7_000_000_000) == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(runtime.CPU_THREADS_ENV, bad)
        with pytest.raises(ConfigError, match=f"{runtime.CPU_THREADS_ENV}='{bad}'"):
            runtime.cpu_threads(3_000_000)


def test_fixed_cpu_threads_restores_the_callers_settings():
    with _threads(2):
        with runtime.fixed_cpu_threads(1):
            assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
        assert torch.get_num_threads() == 2 and not torch.are_deterministic_algorithms_enabled()


def test_free_host_memory_is_positive_and_below_the_physical_memory():
    import os

    free = runtime.free_memory_bytes(torch.device("cpu"))
    assert 0 < free <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize(
    "files, room",
    [
        ({"memory.max": "4294967296\n", "memory.current": "1073741824\n"}, 3 << 30),  # cgroup v2 with a limit
        ({"memory.max": "max\n", "memory.current": "1073741824\n"}, None),  # v2 without
        ({"memory/memory.limit_in_bytes": "2147483648", "memory/memory.usage_in_bytes": "536870912"}, 3 << 29),  # v1
        ({"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "1"}, None),
        ({}, None),
    ],
)
def test_a_containers_memory_limit_caps_the_free_host_memory(tmp_path, files, room):
    """A Kubernetes pod sees the node's /proc/meminfo: the cgroup's limit minus usage is what it may still use."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert runtime._cgroup_room(tmp_path) == room


def test_free_host_memory_is_the_smaller_of_host_and_container_room(monkeypatch):
    monkeypatch.setattr(runtime, "_host_available", lambda: 20 << 30)
    monkeypatch.setattr(runtime, "_cgroup_room", lambda: 3 << 30)
    assert runtime.free_memory_bytes(torch.device("cpu")) == 3 << 30
    monkeypatch.setattr(runtime, "_cgroup_room", lambda: None)
    assert runtime.free_memory_bytes(torch.device("cpu")) == 20 << 30
    monkeypatch.setattr(runtime, "_host_available", lambda: None)
    assert runtime.free_memory_bytes(torch.device("cpu")) == 1 << 30


FREE = {0: 80 << 30, 1: 80 << 30, 2: 40 << 30, "cpu": 500 << 30}  # accelerate's free memory per device


def test_placement_budgets_each_gpu_and_the_host_only_with_offload():
    assert runtime.placement_kwargs("cuda", "auto", free=FREE) == {"device_map": "auto"}
    assert runtime.placement_kwargs("cuda", "auto", "70GiB", free=FREE) == {
        "device_map": "auto",
        "max_memory": {0: 70 << 30, 1: 70 << 30, 2: 40 << 30},  # never more than a GPU has free
    }
    assert runtime.placement_kwargs("cuda", "auto", offload=True, gpus=[1, 2], free=FREE) == {
        "device_map": "auto",
        "max_memory": {1: 80 << 30, 2: 40 << 30, "cpu": 500 << 30},  # a search worker's group, then the host
    }
    assert runtime.placement_kwargs("cuda:1", None, free=FREE) == {"device_map": {"": "cuda:1"}}
    with pytest.raises(ResourceError, match="GPU 3 is not visible"):
        runtime.placement_kwargs("cuda", "auto", gpus=[2, 3], free=FREE)


def test_a_placement_on_the_disk_or_in_host_memory_without_offload_is_refused_naming_the_fix():
    runtime.check_placement(None, False, None)
    runtime.check_placement({"": "cpu"}, False, None)  # no GPU: the host is where the model runs, not an offload
    runtime.check_placement({"model.layers.0": 0, "model.layers.1": "cpu"}, True, "70GB")
    with pytest.raises(ResourceError, match="offload: true") as refused:
        runtime.check_placement({"model.layers.0": 0, "model.layers.1": "cpu", "lm_head": "cpu"}, False, "70GB")
    assert "2 part(s)" in str(refused.value) and "max_memory 70GB" in str(refused.value)
    with pytest.raises(ResourceError, match="on the disk"):
        runtime.check_placement({"model.layers.0": 0, "model.layers.1": "disk"}, True, None)


def test_a_checkpoint_larger_than_the_gpu_budget_is_refused_before_any_weight_loads(tmp_path, monkeypatch):
    runtime.check_budget(100 << 30, None, None)  # no budget: accelerate's own choice
    runtime.check_budget(100 << 30, {0: 70 << 30, "cpu": 500 << 30}, "70GB")  # offload: the host takes the rest
    runtime.check_budget(100 << 30, {0: 70 << 30, 1: 40 << 30}, "70GB")
    with pytest.raises(ResourceError, match=r"100.0 GiB of weights exceed what its 2 GPU\(s\) may hold at max_memory 70GB"):
        runtime.check_budget(100 << 30, {0: 70 << 30, 1: 20 << 30}, "70GB")
    moe.tiny_model("olmoe").save_pretrained(tmp_path)
    monkeypatch.setattr(runtime, "placement_kwargs", lambda *args: {"device_map": "auto", "max_memory": {0: 1024}})
    monkeypatch.setattr(moe, "load_pruned", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    with pytest.raises(ResourceError, match="offload: true"):
        runtime.load_model(str(tmp_path), device="cuda", device_map="auto", max_memory="1KiB")


@pytest.mark.parametrize("settings", [{"max_memory": "70GB"}, {"offload": True}, {"device_map": "auto", "max_memory": "0GB"}])
def test_max_memory_and_offload_need_a_device_map_and_a_size(settings):
    from evoesap.registry import get

    with pytest.raises(ConfigError, match="device_map: auto|positive size"):
        get("calibrate").params_class()(**settings)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_checkpoint_file_nested_too_deeply_is_a_model_error_naming_it(tmp_path, name):
    from evoesap.errors import ModelError

    moe.tiny_model("olmoe").save_pretrained(tmp_path)
    (tmp_path / name).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelError, match=f"{name} is (not valid JSON|malformed).*nest"):
        runtime.check_checkpoint(str(tmp_path))
