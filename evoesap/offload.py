"""A model partly offloaded by accelerate, seen from outside: the device a module computes on and its weights
wherever they are stored.

With a device_map that sends layers to `cpu` beside a GPU (`offload: true`) or to `disk`, accelerate keeps
those layers' weights on the meta device between forwards and lets hooks on their leaf modules bring them to
the execution device for each forward. Code that asks a parameter for its device, or reads the state dict,
meets meta tensors there; it asks here instead."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from evoesap.errors import ModelError


def module_device(module: torch.nn.Module) -> torch.device:
    """The device `module` computes on: its first stored weight's, else the execution device its offload
    hooks name."""
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    for part in module.modules():
        hook = getattr(part, "_hf_hook", None)
        if getattr(hook, "execution_device", None) is not None:
            return torch.device(hook.execution_device)
    raise ModelError(f"{type(module).__name__} has no weights off the meta device and no offload hook naming a device")


def state_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the state dict, an offloaded tensor read from where its hook stores it (host or disk)."""
    stored = {}
    for prefix, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        weights = getattr(hook, "weights_map", None) if getattr(hook, "offload", False) else None
        if weights is not None:
            for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                stored[f"{prefix}.{name}" if prefix else name] = weights[name]
    for name, tensor in model.state_dict().items():
        if tensor.device.type == "meta":
            if name not in stored:
                raise ModelError(f"{name} is on the meta device and no offload hook stores it: the model is not loaded")
            tensor = stored[name]
        yield name, tensor


def stored(module: torch.nn.Module, path: str) -> torch.Tensor:
    """The tensor at dotted `path` under `module` on the device `module` computes on; an offloaded one read
    from where its hook stores it (between forwards accelerate leaves a meta tensor in its place)."""
    *parents, name = path.split(".")
    owner = module
    for part in parents:
        owner = getattr(owner, part)
    tensor = getattr(owner, name)
    if tensor.device.type == "meta":
        hook = getattr(owner, "_hf_hook", None)
        weights = getattr(hook, "weights_map", None)
        if weights is None:
            raise ModelError(f"{path} is on the meta device and no offload hook stores it: the model is not loaded")
        tensor = weights[name]
    return tensor.to(module_device(module))
