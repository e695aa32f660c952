"""evoesap.runtime: models load straight onto their device; free memory as the host and its container allow."""

from __future__ import annotations

import pytest
import torch

from evoesap import moe, runtime


class _Loaded(torch.nn.Module):
    def to(self, *args, **kwargs):  # a whole-model move after loading is what load_model must not do
        raise AssertionError("the model was moved after loading")


def test_load_model_places_weights_on_the_device_while_loading(monkeypatch):
    calls = []
    monkeypatch.setattr(moe, "load_pruned", lambda uri, **kwargs: calls.append(kwargs) or _Loaded())
    runtime.load_model("m", "bfloat16", device="cuda:1")
    runtime.load_model("m", device="cpu")
    runtime.load_model("m", device="cuda", device_map="auto")
    assert calls == [
        {"dtype": torch.bfloat16, "device_map": {"": "cuda:1"}},
        {"dtype": "auto"},
        {"dtype": "auto", "device_map": "auto"},
    ]


def test_a_tiny_checkpoint_loads_on_the_cpu_without_dispatch_hooks(tmp_path):
    moe.tiny_model("olmoe").save_pretrained(tmp_path)
    model = runtime.load_model(str(tmp_path), device="cpu")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert not hasattr(model, "hf_device_map")


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
