"""Write a CycloneDX 1.6 JSON SBOM of a stage image's Python environments, from the images' hashed locks.

One document per image flavour (cpu: images/Dockerfile, cuda: images/Dockerfile.cuda): every package of the
stage environment (/opt/venv), of the vLLM environment (/opt/vllm) and of llm-compressor's (/opt/quantize), each a `library` component with its
purl (pkg:pypi/name@version) and the sha256 the lock makes pip check, plus torch at the images' TORCH_VERSION
and the project's own two distributions. Standard library only, so the image build runs the same file with the
image's Python (it writes /opt/venv/sbom.cdx.json) as `make sbom` and the release workflow do here.

    python images/sbom.py --out dist/sbom                       # stage-cpu.cdx.json and stage-cuda.cdx.json
    python images/sbom.py --flavour cpu --out /opt/venv/sbom.cdx.json --commit "$GIT_COMMIT"
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import sys
import uuid
from pathlib import Path
from urllib.parse import quote

import tomllib

HERE = Path(__file__).resolve().parent
# flavour -> (environment, its lock, torch's local version label); the images install torch before each lock
ENVIRONMENTS = {
    "cpu": (
        ("/opt/venv", "requirements.lock", "+cpu"),
        ("/opt/vllm", "requirements-vllm.lock", "+cpu"),
        ("/opt/quantize", "requirements-quantize.lock", "+cpu"),
    ),
    "cuda": (
        ("/opt/venv", "requirements.lock", ""),
        ("/opt/vllm", "requirements-vllm-cuda.lock", ""),
        ("/opt/quantize", "requirements-quantize.lock", ""),
    ),
}
OWN = {"/opt/venv": "evoesap", "/opt/vllm": "evoesap-vllm"}  # built from this repository's source, no hash (the
# llm-compressor environment /opt/quantize holds nothing of it: the worker script runs from /opt/venv's package)
LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)\s*$")


def purl(name: str, version: str) -> str:
    """Package URL of a PyPI distribution: lower-case name with '-' (the purl spec's pypi rule), encoded version."""
    return f"pkg:pypi/{re.sub(r'[-_.]+', '-', name).lower()}@{quote(version, safe='')}"


def read_lock(path: Path) -> list[tuple[str, str, list[str]]]:
    """(name, version, sha256s) of each line of a hashed lock; any other non-comment line is an error."""
    pins = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            match = LINE.match(line)
            if not match:
                sys.exit(f"sbom: {path.name}:{number} is not `name==version --hash=sha256:...`: {line!r}; run `make lock`")
            pins.append((match[1], match[2], re.findall(r"sha256:([0-9a-f]{64})", match[3])))
    return pins


def torch_version() -> str:
    """images/Dockerfile's TORCH_VERSION (the image build passes its own instead)."""
    return re.search(r"^ARG TORCH_VERSION=(\S+)$", (HERE / "Dockerfile").read_text(), re.M).group(1)


def component(venv: str, name: str, version: str, kind: str = "library", hashes: list[str] = ()) -> dict:
    ref = purl(name, version)
    entry = {"type": kind, "bom-ref": f"{ref}?venv={quote(venv, safe='')}", "name": name, "version": version, "purl": ref}
    if hashes:
        entry["hashes"] = [{"alg": "SHA-256", "content": digest} for digest in hashes]
    entry["properties"] = [{"name": "evoesap:venv", "value": venv}]
    return entry


def sbom(flavour: str, locks: Path, version: str, torch: str, commit: str, created: dt.datetime) -> dict:
    components = []
    for venv, lock, label in ENVIRONMENTS[flavour]:
        if venv in OWN:
            components.append(component(venv, OWN[venv], version, "application"))
        components.append(component(venv, "torch", torch + label))
        components += [component(venv, name, pin, hashes=digests) for name, pin, digests in read_lock(locks / lock)]
    digest = hashlib.sha256(json.dumps([flavour, version, commit, components], sort_keys=True).encode()).hexdigest()
    image = {
        "type": "container",
        "bom-ref": f"evoesap-stage-{flavour}",
        "name": "evoesap/stage",
        "version": f"{version}-{flavour}" if flavour != "cpu" else version,
    }
    if commit:
        image["properties"] = [{"name": "org.opencontainers.image.revision", "value": commit}]
    return {
        "$schema": "http://cyclonedx.org/schema/bom-1.6.schema.json",
        "bomFormat": "CycloneDX",
        "specVersion": "1.6",
        "serialNumber": uuid.uuid5(uuid.NAMESPACE_URL, f"urn:evoesap:sbom:{digest}").urn,  # same inputs, same id
        "version": 1,
        "metadata": {
            "timestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tools": {"components": [{"type": "application", "name": "evoesap images/sbom.py", "version": version}]},
            "component": image,
            "licenses": [{"license": {"id": "Apache-2.0"}}],
        },
        "components": components,
    }


def created_at() -> dt.datetime:
    """SOURCE_DATE_EPOCH when set (reproducible builds), else now."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    return dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc) if epoch else dt.datetime.now(dt.timezone.utc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", choices=sorted(ENVIRONMENTS), help="one image (then --out is the file)")
    parser.add_argument("--out", required=True, type=Path, help="a folder for both, or the file for --flavour")
    parser.add_argument("--locks", type=Path, default=HERE, help="the folder holding the locks (default: images/)")
    parser.add_argument("--pyproject", type=Path, default=HERE.parent / "pyproject.toml", help="the version's source")
    parser.add_argument("--torch", help="torch's version (default: images/Dockerfile's TORCH_VERSION)")
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT", ""), help="the source commit")
    args = parser.parse_args(argv)
    version = tomllib.loads(args.pyproject.read_text())["project"]["version"]
    torch = args.torch or torch_version()
    targets = (
        {args.flavour: args.out}
        if args.flavour
        else {flavour: args.out / f"stage-{flavour}.cdx.json" for flavour in ENVIRONMENTS}
    )
    for flavour, out in targets.items():
        out.parent.mkdir(parents=True, exist_ok=True)
        document = sbom(flavour, args.locks, version, torch, args.commit, created_at())
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(document, indent=1) + "\n")
        partial.replace(out)
        print(f"sbom: wrote {out} ({len(document['components'])} components)")


if __name__ == "__main__":
    main()
