"""Build (or reuse) the demo world: data splits, tokenizer, trained model, lm-eval tasks, in one directory.

The world is cached by content: `world.json` stores a hash of what decides training (`world_key`), and
a call with the same inputs returns at once. A file lock makes concurrent callers
(parallel test sessions) wait for one build instead of training twice. Training runs in a child process
whose environment pins the CPU numerics (`evoesap.demo.numerics`), so every x86-64 machine trains the same weights.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from evoesap import data as _data
from evoesap.demo import domains as _domains
from evoesap.demo import numerics as _numerics
from evoesap.demo import tokenizer as _tokenizer
from evoesap.demo import train as _train
from evoesap.demo.domains import DOMAINS, SPLITS, generate_splits, read_jsonl, write_jsonl
from evoesap.demo.profiles import get_profile
from evoesap.demo.recorded import recorded_world
from evoesap.demo.tasks import TAG, task_name, write_tasks
from evoesap.errors import ArtifactError, ConfigError, ModelError
from evoesap.store import artifacts

log = logging.getLogger(__name__)

WORLD_FILE = "world.json"
MIX = "mix"  # the deployment mix: every domain's samples in turn, what a model serving all of them sees
MIX_SPLITS: tuple[str, ...] = ("calibration", "search", "search_heldout")


@dataclass(frozen=True)
class DemoWorld:
    """Where a built demo world's parts are; `info` holds build figures (time, parameters, bytes)."""

    root: Path
    model_dir: Path
    data_dir: Path
    tasks_dir: Path
    generative_tasks: tuple[str, ...]  # exact-match generate_until tasks, one per domain
    multiple_choice_tasks: tuple[str, ...]
    tag: str  # lm-eval tag that selects every demo task
    seed: int
    profile: str
    key: str  # content hash the cache is keyed on
    info: dict = dataclasses.field(compare=False, hash=False)

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(sorted(DOMAINS))

    def data_file(self, domain: str, split: str) -> Path:
        """JSONL of one domain's split (train, calibration, search, search_heldout, evaluation), or of the
        deployment mix (`MIX`: calibration, search, search_heldout)."""
        known = (domain in DOMAINS and split in SPLITS) or (domain == MIX and split in MIX_SPLITS)
        if not known:
            raise ConfigError(
                f"no demo data for domain {domain!r} split {split!r}; domains {sorted(DOMAINS)} "
                f"with splits {list(SPLITS)}, or {MIX!r} with {list(MIX_SPLITS)}"
            )
        return self.data_dir / domain / f"{split}.jsonl"


def world_key(seed: int, profile: str) -> str:
    """Hash of what decides the world: the data generator, tokenizer and training code, the part of
    `evoesap.data` that makes the answer mask trained on (`encode_sample` and what it calls), the pinned CPU
    numerics training runs with, seed and profile values. An edit anywhere else (the rest of `evoesap.data`
    included) keeps the built world.

    Library versions are recorded in `info` but not keyed on, so a world built elsewhere can be reused.
    """
    h = hashlib.sha256()
    for module in (_domains, _tokenizer, _train):
        h.update(Path(module.__file__).read_bytes())
    h.update(source_closure(Path(_data.__file__), "encode_sample").encode())
    h.update(json.dumps({"seed": seed, "profile": dataclasses.asdict(get_profile(profile))}, sort_keys=True).encode())
    h.update(json.dumps({"numerics": _numerics.PINNED_NUMERICS}, sort_keys=True).encode())
    return h.hexdigest()


def source_closure(path: Path, *roots: str) -> str:
    """The source of the top-level definitions (functions, classes, assignments) of the Python file `path`
    that `roots` reach by name, in file order: all of that file that can change what `roots` compute."""
    text = path.read_text(encoding="utf-8")
    body = ast.parse(text).body
    defined: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        defined[name.id] = node
    missing = [r for r in roots if r not in defined]
    if missing:
        raise ConfigError(f"{path} defines no {missing} at top level; name functions or classes it defines")
    reached: set[int] = set()
    todo = list(roots)
    while todo:
        node = defined.get(todo.pop())
        if node is None or id(node) in reached:
            continue
        reached.add(id(node))
        todo.extend(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
    lines = text.splitlines()
    spans = [
        (min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno]), node.end_lineno)
        for node in body
        if id(node) in reached
    ]  # decorators included: @dataclass(frozen=True) matters
    return "\n".join("\n".join(lines[a - 1 : b]) for a, b in spans)


@contextlib.contextmanager
def _lock(root: Path) -> Iterator[None]:
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _world(root: Path, meta: dict) -> DemoWorld:
    mc = tuple(task_name(d, True) for d in sorted(DOMAINS) if DOMAINS[d].multiple_choice)
    return DemoWorld(
        root=root,
        model_dir=root / "model",
        data_dir=root / "data",
        tasks_dir=root / "tasks",
        generative_tasks=tuple(task_name(d) for d in sorted(DOMAINS)),
        multiple_choice_tasks=mc,
        tag=TAG,
        seed=meta["seed"],
        profile=meta["profile"],
        key=meta["key"],
        info=meta["info"],
    )


def _ensure_tasks(root: Path) -> None:
    """(Re)write the task YAMLs so their absolute paths point here, even if the directory was moved."""
    tok = transformers.AutoTokenizer.from_pretrained(str(root / "model"))
    files = {d: root / "data" / d / "evaluation.jsonl" for d in sorted(DOMAINS)}
    write_tasks(root / "tasks", files, tok, multiple_choice=tuple(d for d in DOMAINS if DOMAINS[d].multiple_choice))


def _ensure_mix(data_dir: Path) -> None:
    """(Re)write the deployment mix from the domains' splits: one sample of each domain in turn (sorted
    names), the larger domains' rest at the end, so any prefix of it is as balanced as the data allows. A
    function of the domain files only, so an existing world gains it without retraining."""
    for split in MIX_SPLITS:
        rows = [read_jsonl(data_dir / d / f"{split}.jsonl") for d in sorted(DOMAINS)]
        mixed = [row[i] for i in range(max(map(len, rows))) for row in rows if i < len(row)]
        path = data_dir / MIX / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in mixed)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            staging = path.with_name(f".{path.name}.partial")
            staging.write_text(text, encoding="utf-8")
            staging.replace(path)


BUILD_INFO = ".build-info.json"  # the child's figures, read and removed by the parent


def _build_in_child(staging: Path, seed: int, profile_name: str) -> dict:
    """`_build_into` in a fresh interpreter whose environment pins the CPU numerics (read when torch is
    imported, so this process's torch cannot be switched); returns its build figures."""
    env = _numerics.pinned_environment(os.environ)
    package_root = Path(__file__).resolve().parents[2]
    if package_root.name not in ("site-packages", "dist-packages"):  # a checkout: the child imports this very evoesap
        env["PYTHONPATH"] = os.pathsep.join([str(package_root), *filter(None, [os.environ.get("PYTHONPATH")])])
    level = logging.getLogger("evoesap").getEffectiveLevel()
    code = "import sys; from evoesap.demo.world import _child_main; _child_main(sys.argv[1:])"
    argv = [sys.executable, "-c", code, str(staging), str(seed), profile_name, str(level)]
    child = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=_end_with_parent)
    try:
        returncode = child.wait()
    finally:  # interrupted (Ctrl-C, an exception in a signal handler): the training goes too
        if child.poll() is None:
            child.kill()
            child.wait()
    info_path = staging / BUILD_INFO
    if returncode != 0 or not info_path.exists():
        raise ModelError(
            f"training the demo world (seed {seed}, profile {profile_name!r}) failed in its child process "
            f"(exit code {returncode}); its error is printed above"
        )
    info = json.loads(info_path.read_text())
    info_path.unlink()
    return info


def _end_with_parent() -> None:
    """In the training child before it starts: on Linux, SIGTERM when the building process ends however it ends
    (killed, say, as the test session stops its background build), so no training outlives its build."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _child_main(args: list[str]) -> None:
    """Entry point of the training child: `staging seed profile log-level`."""
    staging, seed, profile_name, level = args
    logging.basicConfig(level=int(level), format="%(levelname)s %(name)s: %(message)s")  # as the CLI logs
    info = _build_into(Path(staging), int(seed), profile_name)
    (Path(staging) / BUILD_INFO).write_text(json.dumps(info))


def _build_into(staging: Path, seed: int, profile_name: str, weights: Path | None = None) -> dict:
    """Generate data, build the tokenizer, train (or take the shipped `weights`) and save the model into `staging`;
    returns build figures. Training runs in the training child (`_build_in_child`), whose environment pins the
    numerics; shipped weights need no training, so no child."""
    profile = get_profile(profile_name)
    capability = _numerics.check_pinned() if weights is None else None
    start = time.perf_counter()
    train_sets: dict[str, list[list[dict]]] = {}
    for domain in sorted(DOMAINS):
        splits = generate_splits(domain, seed, profile.train_size)
        for split, samples in splits.items():
            write_jsonl(samples, staging / "data" / domain / f"{split}.jsonl")
        train_sets[domain] = [row["messages"] for row in read_jsonl(staging / "data" / domain / "train.jsonl")]
    tok = _tokenizer.build_tokenizer(model_max_length=profile.max_positions)
    model = _train.make_model(profile, tok, seed)
    figures = _train.train(model, tok, train_sets, profile, seed) if weights is None else {}
    model_dir = staging / "model"
    model.save_pretrained(str(model_dir), safe_serialization=True)
    if weights is not None:  # the very file training saves, so the checkpoint is byte for byte the trained one
        shutil.copyfile(weights, model_dir / "model.safetensors")
    _tokenizer.save_tokenizer(tok, model_dir)
    params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    source = "trained" if weights is None else "shipped"
    files = sorted(model_dir.glob("*.safetensors"))
    return dict(
        figures,
        build_seconds=time.perf_counter() - start,
        parameters=params,
        expert_parameters=expert_params,
        parameter_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        safetensors_bytes=sum(f.stat().st_size for f in files),
        weights_sha256=weights_hash(model_dir),
        torch_threads=profile.threads,
        weights_source=source,
        cpu_capability=capability,
        numerics={name: os.environ.get(name) for name in _numerics.PINNED_NUMERICS} if source == "trained" else None,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
    )


def weights_hash(model_dir: Path) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes) of a checkpoint: equal iff weights are equal."""
    from safetensors import safe_open

    h = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def load_demo_world(out_dir: str | Path) -> DemoWorld:
    """The world already built in `out_dir`, without building."""
    root = Path(out_dir).resolve()
    meta_path = root / WORLD_FILE
    if not meta_path.exists():
        raise ArtifactError(f"{root} holds no finished demo world ({WORLD_FILE} missing); run `evoesap demo build`")
    return _world(root, json.loads(meta_path.read_text()))


SHIPPED_WEIGHTS = Path(__file__).parent / "weights"  # the recorded worlds' trained weights, `<profile>-seed<seed>.safetensors`


def shipped_weights(seed: int, profile: str, key: str) -> Path | None:
    """The trained weights that ship with the package for this world, when the code still builds the recorded
    world (same key): building then takes seconds instead of training for minutes, on any CPU."""
    recorded = recorded_world(profile, seed)
    path = SHIPPED_WEIGHTS / f"{profile}-seed{seed}.safetensors"
    return path if recorded is not None and recorded.key == key and path.is_file() else None


def build_demo_world(
    out_dir: str | Path, seed: int = 0, profile: str = "default", force: bool = False, train: bool = False
) -> DemoWorld:
    """Build the demo world in `out_dir`, or return the cached one when code, seed and profile match.

    The recorded worlds' weights ship with the package and are used when the code still builds that world;
    `train` trains them instead and fails unless training reproduces the recorded weights bit for bit. A
    directory that is not a demo world is never overwritten; a demo world with another key is rebuilt.
    """
    root = Path(out_dir).resolve()
    key = world_key(seed, profile)
    weights = None if train else shipped_weights(seed, profile, key)
    with _lock(root):
        meta_path = root / WORLD_FILE
        if root.exists() and any(root.iterdir()) and not meta_path.exists() and not force:
            raise ConfigError(f"{root} exists and is not a demo world; choose an empty directory or pass force")
        if meta_path.exists() and not force and not train:
            meta = json.loads(meta_path.read_text())
            if meta.get("key") == key:
                log.info("demo world in %s is up to date (key %s)", root, key[:12])
                _ensure_tasks(root)
                _ensure_mix(root / "data")
                return _world(root, meta)
            log.info("demo world in %s was built from other inputs; rebuilding", root)
        log.info("building demo world (seed %d, profile %s) in %s", seed, profile, root)
        staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.build-", dir=root.parent))
        os.chmod(staging, 0o777 & ~artifacts.umask())  # it becomes the world: the mode mkdir gives, not 0700
        try:
            info = _build_in_child(staging, seed, profile) if weights is None else _build_into(staging, seed, profile, weights)
            _check_recorded(seed, profile, key, info, required=train or weights is not None)
            meta = {"key": key, "seed": seed, "profile": profile, "info": info}
            (staging / WORLD_FILE).write_text(json.dumps(meta, indent=2))
            if root.exists():
                trash = root.with_name(f".{root.name}.old-{int(time.time())}")
                root.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
            staging.rename(root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        _ensure_tasks(root)
        _ensure_mix(root / "data")
        log.info("demo world built in %.0fs (%s weights): %s", info["build_seconds"], info["weights_source"], root)
        return _world(root, meta)


def world_identity(world: DemoWorld) -> str:
    """One line naming the world by key and weights digest, and whether it is the recorded one (the one whose
    figures docs/results/demo.md and the README report)."""
    digest = world.info["weights_sha256"]
    recorded = recorded_world(world.profile, world.seed)
    if recorded is None:
        verdict = "no recorded world for this seed and profile"
    elif recorded.key != world.key:
        verdict = f"NOT the recorded world: the code's key was {recorded.key[:12]} when its figures were recorded"
    elif recorded.weights_sha256 != digest:
        verdict = f"NOT the recorded world: same key, but the recorded weights are {recorded.weights_sha256[:12]}"
    else:
        verdict = "the recorded world, whose figures docs/results/demo.md reports"
    return f"world key {world.key[:12]}, weights sha256 {digest[:12]} ({verdict})"


def _check_recorded(seed: int, profile: str, key: str, info: dict, required: bool) -> None:
    """When this world should be a recorded one (same key) but its weights are not the recorded ones: an error
    when `required` (shipped weights, or training asked to reproduce them), else a warning."""
    recorded = recorded_world(profile, seed)
    if recorded is None or recorded.key != key or recorded.weights_sha256 == info["weights_sha256"]:
        return
    message = (
        f"demo world (seed {seed}, profile {profile}) has {info['weights_source']} weights "
        f"{info['weights_sha256'][:12]}, not the recorded {recorded.weights_sha256[:12]} (torch "
        f"{info.get('torch_version')}, transformers {info.get('transformers_version')} here; recorded with torch "
        f"{recorded.torch_version}, transformers {recorded.transformers_version}; torch kernels "
        f"{info.get('cpu_capability')}): its results would differ from docs/results/demo.md"
    )
    if not required:
        log.warning("%s", message)
    elif info["weights_source"] == "shipped":
        raise ArtifactError(f"{message}; the shipped file {SHIPPED_WEIGHTS} is damaged: reinstall evoesap")
    else:
        raise ModelError(f"{message}; training does not reproduce the recorded world on this machine")
