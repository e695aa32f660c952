"""evoesap.runtime: models load straight onto their device."""

from __future__ import annotations

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
