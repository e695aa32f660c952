"""Loading a model for a stage: dtype and device choices shared by every stage that runs a model."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from evoesap.errors import ArtifactError, ConfigError, ModelError, ResourceError
from evoesap.offload import module_device
from evoesap.store import artifacts, jsontext
from evoesap.store.identity import is_uri

log = logging.getLogger(__name__)

MODEL_DTYPES: dict[str, Any] = {
    "auto": "auto",  # the checkpoint's own dtype
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


# host allocations of at least this many bytes go straight to mmap and back to the OS when freed
MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def bound_allocator_retention() -> None:
    """Fix glibc's mmap threshold (which otherwise rises after each large free), so that the multi-MiB
    buffers transformers frees while it restacks a checkpoint's experts return to the OS instead of
    staying in the heap: 224 MiB less resident after loading a 1 GB OLMoE-shaped model on the CPU
    (docs/results/memory.md). Nothing happens where the C library is not glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


# CPU threads. A model below this many parameters runs its CPU work on one intra-op thread: its ops are too
# small to gain from a second thread, and torch's OpenMP threads spin-wait for each other, so whenever another
# process holds a core a training that takes 3 minutes on 2 idle cores took 47 (docs/results/speed.md,
# "CPU threads under load"). Larger models keep torch's own thread count (all cores).
TINY_MODEL_PARAMETERS = 50_000_000
CPU_THREADS_ENV = "EVOESAP_CPU_THREADS"  # an explicit intra-op thread count for CPU work, whatever the model size
_threads_before_tiny: int | None = None  # torch's count before use_cpu_threads lowered it for a tiny model


def cpu_threads(parameters: int) -> int | None:
    """Intra-op threads for CPU work on a model of `parameters` parameters: EVOESAP_CPU_THREADS when set,
    1 for a tiny model, None (torch's own choice) otherwise."""
    explicit = os.environ.get(CPU_THREADS_ENV, "").strip()
    if explicit:
        if not explicit.isdigit() or int(explicit) < 1:
            raise ConfigError(
                f"{CPU_THREADS_ENV}={explicit!r} is not a positive whole number of threads; set it to e.g. 1 or unset it"
            )
        return int(explicit)
    return 1 if parameters < TINY_MODEL_PARAMETERS else None


def use_cpu_threads(parameters: int) -> int:
    """Set torch's intra-op thread count for CPU work on a model of this size (`cpu_threads`); returns it.

    A larger model after a tiny one gets back the count torch had before the tiny one lowered it."""
    global _threads_before_tiny
    wanted = cpu_threads(parameters)
    if wanted is None:
        if _threads_before_tiny is not None:
            torch.set_num_threads(_threads_before_tiny)
            _threads_before_tiny = None
        return torch.get_num_threads()
    if _threads_before_tiny is None:
        _threads_before_tiny = torch.get_num_threads()
    torch.set_num_threads(wanted)
    return wanted


@contextlib.contextmanager
def fixed_cpu_threads(threads: int) -> Iterator[None]:
    """Exactly `threads` intra-op threads and deterministic kernels for the duration (the demo's training,
    whose weights must not depend on the machine), restoring the caller's settings after."""
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_det, warn_only=old_warn)
        torch.set_num_threads(old_threads)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def check_model_dtype(name: str) -> None:
    if name not in MODEL_DTYPES:
        raise ConfigError(f"model_dtype {name!r} is not one of {', '.join(MODEL_DTYPES)}")


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(name: str) -> None:
    """Refuse a device this machine does not have (`cuda` without a GPU, `cuda:7` with two), before any work."""
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {name!r} is not a device: give auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = visible_gpus()
        if not count:
            raise ConfigError(f"device {name!r}: no GPU is visible on this machine: give --device cpu (or auto)")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"device {name!r}: this machine has {count} GPU(s), cuda:0..cuda:{count - 1}: give one of them")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {name!r}: MPS is not available on this machine: give --device cpu (or auto)")
    elif device.type not in ("cpu", "mps"):  # torch names more (xla, meta, hpu...); the stages run on these
        raise ConfigError(f"device {name!r} is not supported: give auto, cpu, cuda or cuda:N")


def check_gpu_count(needed: int, setting: str) -> None:
    """Refuse a setting that spans more GPUs than this machine shows, before any work."""
    count = visible_gpus()
    if needed > count:
        raise ConfigError(
            f"{setting} = {needed} GPUs, but this machine shows {count}: lower it to at most "
            f"{max(count, 1)} (or run where {needed} GPUs are visible)"
        )


CPU_OVERSUBSCRIPTION = 4  # processes per core beyond which more only wait on each other (and each holds a replica)


def check_cpu_count(needed: int, setting: str) -> None:
    """Refuse a setting that starts more processes, each with a model replica, than this process's CPU cores can
    serve (`CPU_OVERSUBSCRIPTION` a core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if needed > CPU_OVERSUBSCRIPTION * cores:
        raise ConfigError(
            f"{setting} = {needed} processes on the CPU, but this machine gives this process {cores} cores: lower it "
            f"to at most {CPU_OVERSUBSCRIPTION * cores} (or run on GPUs)"
        )


def check_checkpoint(uri: str) -> None:
    """Refuse a local checkpoint directory that cannot load: config.json missing, not JSON or not a valid
    transformers config; safetensors weights missing, unreadable or shorter than their headers say
    (truncated). Only config.json and the shards' headers are read. Hub names and URIs are left to the loader."""

    from evoesap.moe import shards
    from evoesap.moe.stream_prune import INDEX_FILE, SINGLE_FILE

    root = Path(uri)
    if "://" in uri or not root.is_dir():
        return
    hint = "fix it or copy the checkpoint again"
    try:
        config = json.loads((root / "config.json").read_bytes())
    except FileNotFoundError:
        raise ModelError(f"{uri} has no config.json: give a transformers checkpoint directory") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = "it nests too deeply to read" if isinstance(exc, RecursionError) else exc
        raise ModelError(f"{uri}/config.json is not valid JSON ({why}): {hint}") from None
    from evoesap.moe.stream_prune import config_from_dict

    try:
        config_from_dict(config)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for one bad value
        why = " ".join(str(exc).split())  # one line, however transformers wraps its message
        raise ModelError(f"{uri}/config.json is not a valid transformers config ({type(exc).__name__}: {why}): {hint}") from None
    if (root / INDEX_FILE).is_file():
        try:
            names = sorted(set(jsontext.loads((root / INDEX_FILE).read_bytes(), INDEX_FILE)["weight_map"].values()))
        except (ArtifactError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(f"{uri}/{INDEX_FILE} is malformed ({type(exc).__name__}: {exc}): {hint}") from None
    elif (root / SINGLE_FILE).is_file():
        names = [SINGLE_FILE]
    else:
        raise ModelError(
            f"{uri} has no {SINGLE_FILE} or {INDEX_FILE}: its weights are missing (only safetensors "
            "checkpoints are read); copy them into it"
        )
    for name in names:
        try:
            with open(root / name, "rb") as f:
                start, entries, _ = shards.read_header(f)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            raise ModelError(f"{uri}/{INDEX_FILE} lists {name}, which is missing: copy it into the checkpoint") from None
        except (ArtifactError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"{uri}/{name} is not a readable safetensors file ({exc}): {hint}") from None
        needed = start + max((e.end for e in entries.values()), default=0)
        if size < needed:
            raise ModelError(f"{uri}/{name} is truncated ({size} bytes, its header needs {needed}): {hint}")


def resolve_device(name: str) -> str:
    """`auto` is cuda when a GPU is present, else cpu."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def load_model(
    uri: str,
    model_dtype: str = "auto",
    device: str = "auto",
    device_map: str | None = None,
    *,
    max_memory: str | None = None,
    offload: bool = False,
    gpus: Sequence[int] | None = None,
) -> Any:
    """A checkpoint (stock or pruned) in eval mode, its weights loaded straight onto their device: never a
    whole host copy first (a 61 GB model on a 24 GB host). `device_map` shards it over several GPUs (`gpus`:
    which, default all), each holding at most `max_memory`; `offload` lets the layers no GPU holds wait in host
    memory, and without it such a placement is refused.

    A checkpoint we published (a prune or quantize artifact) is verified file by file first, on the one local copy
    that is loaded (an object-store checkpoint is downloaded once). A model on the CPU sets torch's thread
    count for its size (`use_cpu_threads`)."""
    from evoesap import moe

    check_model_dtype(model_dtype)
    bound_allocator_retention()
    kwargs = placement_kwargs(device, device_map, max_memory, offload, gpus)
    remote = is_uri(uri) and not artifacts.is_local(uri)
    with artifacts.local_copy(uri) if remote else contextlib.nullcontext(uri) as source:
        if artifacts.exists(artifacts.join(str(source), artifacts.MANIFEST)):
            stage = artifacts.read_manifest(str(source)).stage
            artifacts.verify(uri, stage if stage in CHECKPOINT_STAGES else "prune", local=Path(source))
        budget = kwargs.get("max_memory")
        if budget and "cpu" not in budget and model_dtype == "auto" and Path(str(source)).is_dir():
            check_budget(checkpoint_bytes(str(source)), budget, max_memory)  # as stored: a floor of the loaded size
        try:
            model = moe.load_pruned(str(source), dtype=MODEL_DTYPES[model_dtype], **kwargs).eval()
        except (OSError, ValueError) as exc:  # checked before any work: it changed since (deleted, half copied)
            check_checkpoint(str(source))  # says what is missing or broken now, where it can
            why = " ".join(str(exc).split())[:300]
            raise ModelError(
                f"{artifacts.redact(uri)} could not be loaded ({type(exc).__name__}: {why}): give a complete "
                "checkpoint (was it changed or deleted during this run?)"
            ) from None
    check_placement(getattr(model, "hf_device_map", None), offload, max_memory)
    if getattr(model, "ct_decompress_hook", None) is not None:
        # a compressed-tensors checkpoint decompresses on the whole model's first forward (a pre-hook); evoesap's
        # layer-by-layer forwards (held-out ESAP) never call the whole model, so one token's forward fires it now
        with torch.no_grad():
            model(torch.zeros((1, 1), dtype=torch.long, device=module_device(model.get_input_embeddings())))
    if "device_map" not in kwargs:
        use_cpu_threads(parameter_count(model))
    return model


def placement_kwargs(
    device: str,
    device_map: str | None,
    max_memory: str | None = None,
    offload: bool = False,
    gpus: Sequence[int] | None = None,
    free: dict[int | str, int] | None = None,
) -> dict[str, Any]:
    """from_pretrained's placement arguments. With `device_map`, a `max_memory` budget per device when asked
    for: each of `gpus` (default every GPU in `free`, accelerate's free memory per device) at most
    `max_memory`, and the host only with `offload`."""
    if device_map is None:
        placement = placement_map(resolve_device(device))
        return {"device_map": placement} if placement else {}
    if max_memory is None and not offload and gpus is None:
        return {"device_map": device_map}
    from evoesap.machine.sizes import parse_bytes

    if free is None:
        from accelerate.utils import get_max_memory

        free = get_max_memory()
    cap = parse_bytes(max_memory) if max_memory is not None else None
    budget: dict[int | str, int] = {}
    for gpu in gpus if gpus is not None else [k for k in free if isinstance(k, int)]:
        if gpu not in free:
            raise ResourceError(f"GPU {gpu} is not visible here ({visible_gpus()} GPUs): give this process fewer GPUs")
        budget[gpu] = min(free[gpu], cap) if cap is not None else free[gpu]
    if not budget and not offload:  # accelerate would put every layer on the disk
        raise ResourceError(
            f"max_memory {max_memory} caps what each GPU holds, but this machine shows no GPU: leave device_map and "
            "max_memory unset to load the model in host memory, or run where GPUs are visible"
        )
    if offload:
        budget["cpu"] = free["cpu"]
    return {"device_map": device_map, "max_memory": budget}


CHECKPOINT_STAGES = ("prune", "quantize")  # the stages whose artifact is a checkpoint that loads as a model


def checkpoint_bytes(uri: str) -> int:
    """Bytes of a checkpoint's safetensors files (the weights as stored), at a path or fsspec URI."""
    fs, root = artifacts.split(uri)
    return sum(fs.size(path) for path in fs.find(root) if path.endswith(".safetensors"))


def stored_bytes(model: str) -> int | None:
    """`checkpoint_bytes` of what `model` names: a path, URI or hub name (its files as the hub cache holds them at
    the commit that loaded); None where the files are not at hand."""
    from evoesap.store.identity import hub_model, locate

    if hub_model(model) is None:
        found = checkpoint_bytes(model)
        if not found:  # it loaded from safetensors a moment ago
            raise ModelError(
                f"{artifacts.redact(model)} holds no safetensors weights now: it was deleted or changed during this run; "
                "re-run when it is in place"
            )
        return found
    import huggingface_hub

    name, pinned = locate(model)
    try:
        local = huggingface_hub.snapshot_download(name, allow_patterns=["*.safetensors"], local_files_only=True, **pinned)
    except Exception as exc:  # noqa: BLE001 - the bytes are a figure of the report, not a condition of the run
        log.warning("the stored size of %s is unknown (%s: %s)", model, type(exc).__name__, exc)
        return None
    return checkpoint_bytes(local)


def placement_map(device: str) -> dict[str, str] | None:
    """The `device_map` that puts the whole model on one device as it loads; None for the CPU, where
    transformers loads anyway (and a device_map would add dispatch hooks for nothing)."""
    return None if torch.device(device).type == "cpu" else {"": device}


def check_budget(weights: int, budget: dict[int | str, int] | None, max_memory: str | None) -> None:
    """Refuse, before any weight loads, a checkpoint of `weights` bytes that the GPUs of a `max_memory` budget
    (`placement_kwargs`) cannot hold when the host is not in it (no `offload`): accelerate would put the rest
    on the disk. `check_placement` judges the placement accelerate then makes."""
    if not budget or "cpu" in budget:
        return
    gpus = sum(budget.values())
    if weights > gpus:
        cap = f" at max_memory {max_memory}" if max_memory else ""
        raise ResourceError(
            f"the checkpoint's {weights / 2**30:.1f} GiB of weights exceed what its {len(budget)} GPU(s) may hold{cap} "
            f"({gpus / 2**30:.1f} GiB). Set offload: true to keep the rest in host memory (each forward copies it over "
            f"PCIe; evoesap plan says how slow), or use more GPUs or a larger max_memory"
        )


def check_placement(device_map: dict[str, Any] | None, offload: bool, max_memory: str | None) -> None:
    """Refuse a model that accelerate put (partly) on the disk, or in host memory beside GPUs without `offload`:
    every forward would copy those layers in, slowly, where the user asked for GPUs."""
    if not device_map:
        return
    places = {str(v) for v in device_map.values()}
    on_gpu = places - {"cpu", "disk"}
    cap = f" at max_memory {max_memory}" if max_memory else ""
    if "disk" in places:
        raise ResourceError(
            f"the model does not fit the GPUs{cap} and host memory: accelerate put layers on the disk. Use more GPUs "
            f"(device_map over more), a larger max_memory, or a machine with more host memory"
        )
    if on_gpu and "cpu" in places and not offload:
        moved = sorted(k for k, v in device_map.items() if str(v) == "cpu")
        raise ResourceError(
            f"the model does not fit the GPUs{cap}: {len(moved)} part(s) ({', '.join(moved[:3])}...) would wait in host "
            f"memory. Set offload: true to accept that (each forward copies them over PCIe; evoesap plan says how "
            f"slow), or use more GPUs or a larger max_memory"
        )


def release_memory() -> None:
    """Return a dropped model's memory (host and GPU) before another process loads one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def inspect_checkpoint(uri: str) -> Any:
    """The MoE layout of a full (unpruned) checkpoint from its config alone, without loading weights."""
    from transformers import AutoConfig

    from evoesap import moe
    from evoesap.store.identity import locate

    if is_uri(uri):
        from evoesap.moe.stream_prune import config_from_dict

        config = config_from_dict(artifacts.read_json(artifacts.join(uri, "config.json")))
    else:
        source, pinned = locate(uri)  # a missing path is never sent to the hub; a hub model at its commit
        config = AutoConfig.from_pretrained(source, trust_remote_code=False, **pinned)
    if getattr(config, moe.PER_LAYER_KEY, None):
        raise ConfigError(f"{artifacts.redact(uri)} is already pruned: give the full model")
    return moe.inspect(moe.spec.meta_model(config))


def tokenized_samples(model: str, data: str, params: Any, *, pack: bool = False) -> tuple[Any, list]:
    """(tokenizer, tokenized samples) of a stage's data, drawn and tokenized as its parameters say.

    `params` (`evoesap.params.SampleParams`) says which samples and how. Unset `samples` takes the stage's
    default count, or every row of a smaller source (with a warning); a count asked for that is larger than
    the source is refused.
    """
    from evoesap import data as data_mod
    from evoesap import moe
    from evoesap.errors import DataError

    samples = data_mod.load_samples(
        data,
        split=params.split,
        subset=params.subset,
        fields=params.fields,
        n=params.sample_count,
        seed=params.seed,
        at_most=params.samples is None,
    )
    tokenizer = moe.load_tokenizer(model)
    if tokenizer is None:
        raise DataError(f"{artifacts.redact(model)} has no tokenizer files: save the tokenizer with the model")
    tokenized = data_mod.tokenize_samples(
        samples, tokenizer, max_length=params.max_length, enable_thinking=params.enable_thinking, pack=pack
    )
    return tokenizer, tokenized


def free_memory_bytes(device: torch.device) -> int:
    """Memory still free on `device`: the GPU's own, else the host's available memory, capped by the
    container's memory limit when there is one (a Kubernetes pod sees the node's /proc/meminfo); 1 GiB
    if neither can be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free = [room for room in (_host_available(), _cgroup_room()) if room is not None]
    return min(free) if free else 1 << 30


# (limit, usage) files of cgroup v2, then v1
_CGROUP_FILES = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))


def _host_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Limit minus usage of this process's memory cgroup; None when unlimited or unreadable."""
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        return max(0, int(limit) - usage)
    return None
