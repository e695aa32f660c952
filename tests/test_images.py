"""The stage images: one lock agreeing with pyproject.toml, pinned bases, a numeric user, only what they
copy in the build context, and the build's git commit reaching the manifests."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from evoesap import artifacts

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {name: (ROOT / "images" / name).read_text() for name in ("Dockerfile", "Dockerfile.cuda")}


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "images" / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version and " " not in line, f"not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def _arg(text: str, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S*)$", text, re.M)
    assert match, f"no ARG {name}"
    return match.group(1)


def test_lock_pins_every_dependency_within_pyproject_ranges():
    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    pins = _lock()
    for req in deps:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is in pyproject.toml but not in images/requirements.lock: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"lock pins {req.name}=={pins[name]} outside pyproject's {req.specifier}: run `make lock`")


def test_lock_holds_no_cuda_runtime_wheels():
    assert not [n for n in _lock() if n.startswith("nvidia-") or n in {"triton"}]


def test_both_images_build_torch_the_lock_pins():
    versions = {name: _arg(text, "TORCH_VERSION") for name, text in DOCKERFILES.items()}
    assert set(versions.values()) == {_lock()["torch"]}


def test_cpu_image_takes_torch_cpu_build_and_checks_it():
    text = DOCKERFILES["Dockerfile"]
    assert '"torch==${TORCH_VERSION}+cpu"' in text
    assert "torch.version.cuda is None" in text


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_image_base_is_pinned_by_digest(name):
    assert re.fullmatch(r"[\w./:-]+@sha256:[0-9a-f]{64}", _arg(DOCKERFILES[name], "BASE"))
    assert re.search(r"^FROM \$\{BASE\}$", DOCKERFILES[name], re.M)


def test_images_share_one_base():
    assert len({_arg(text, "BASE") for text in DOCKERFILES.values()}) == 1


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_image_installs_with_the_lock_and_runs_as_a_numeric_user(name):
    text = DOCKERFILES[name]
    assert "pip install -r requirements.lock" in text and "pip install --no-deps -c requirements.lock ." in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and re.fullmatch(r"\d+:\d+", users[-1]) and not users[-1].startswith("0:"), users
    assert "EVOESAP_GIT_COMMIT=${GIT_COMMIT}" in text


def _dockerignore_allows(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `*` then `!path` whitelists."""
    allowed = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        if pattern == "*" or path == pattern or path.startswith(pattern + "/"):
            allowed = negate
    return allowed


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_build_context_holds_what_the_image_copies_and_no_venv(name):
    sources = [src for line in re.findall(r"^COPY (.+)$", DOCKERFILES[name], re.M) for src in line.split()[:-1]]
    sources += re.findall(r"source=([^,\s]+)", DOCKERFILES[name])
    assert sources
    for src in sources:
        assert _dockerignore_allows(src.rstrip("/")), f"{src} is copied by {name} but excluded by .dockerignore"
    for private in (".venv", ".git", "runs", ".cache", "tests"):
        assert not _dockerignore_allows(private), f"{private} would be sent to the image build"


def test_manifest_records_the_image_git_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOESAP_GIT_COMMIT", "0123abc")
    with artifacts.stage_output(str(tmp_path / "a"), "demo", {}, {}) as staging:
        (staging / "x").write_text("x")
    assert artifacts.read_manifest(str(tmp_path / "a")).git_commit == "0123abc"
