#!/usr/bin/env bash
# Build the CPU stage image on this machine and run a stage in it (`make image`).
#
# The public container registry is not reachable here, so the Dockerfile's pinned BASE is replaced by an
# equivalent base bootstrapped from Debian packages (bookworm + its python3.11), built once and cached in
# .cache/image/. The Dockerfile itself is used unchanged. torch's CPU wheel comes from pip's find-links
# directories when they hold one (PIP_FIND_LINKS), else from TORCH_INDEX_URL.
#
# Environment: DEBIAN_MIRROR (default: the first mirror in this host's apt sources), IMAGE (tag),
# SKIP_RUN=1 to build only.
set -euo pipefail
cd "$(dirname "$0")/.."
export BUILDAH_ISOLATION=chroot
STATE=.cache/image
IMAGE=${IMAGE:-localhost/evoesap/stage:cpu}
BASE=localhost/evoesap/base:bookworm
mkdir -p "$STATE"

mirror=${DEBIAN_MIRROR:-$(grep -hoE '^(URIs:|deb) +[a-z]+://[^ ]+' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
    | grep -v security | head -n1 | awk "{print \$2}" || true)}
[ -n "$mirror" ] || { echo "image: no Debian mirror found: set DEBIAN_MIRROR" >&2; exit 1; }

if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
    if [ ! -f "$STATE/rootfs.tar" ]; then
        echo "image: bootstrapping a Debian bookworm base (python3.11) into $STATE/rootfs"
        rm -rf "$STATE/rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$STATE/rootfs" "$mirror" \
            > "$STATE/debootstrap.log"
        rm -rf "$STATE/rootfs/var/cache/apt/archives"/*.deb "$STATE/rootfs/var/lib/apt/lists"/*
        tar -C "$STATE/rootfs" -cf "$STATE/rootfs.tar.partial" . && mv "$STATE/rootfs.tar.partial" "$STATE/rootfs.tar"
        rm -rf "$STATE/rootfs"
    fi
    ctr=$(buildah from scratch)
    buildah add "$ctr" "$STATE/rootfs.tar" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
    buildah commit --quiet "$ctr" "$BASE" >/dev/null
    buildah rm "$ctr" >/dev/null
fi

# torch's CPU wheel for the image's Python (3.11), when a find-links directory has it
rm -f images/wheels/*.whl
for dir in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
    cp "$dir"/torch-*+cpu-cp311-*.whl images/wheels/ 2>/dev/null || true
done
commit=$(git rev-parse HEAD)
version=$(.venv/bin/python -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
echo "image: building $IMAGE from images/Dockerfile at $commit"
buildah bud --quiet --layers --isolation chroot --build-arg BASE="$BASE" --build-arg GIT_COMMIT="$commit" \
    --build-arg VERSION="$version" --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    ${TORCH_INDEX_URL:+--build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL"} \
    --secret id=pip-cert,src=/etc/ssl/certs/ca-certificates.crt \
    -f images/Dockerfile -t "$IMAGE" .
rm -f images/wheels/*.whl
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$IMAGE"
# the SBOM the image holds (/opt/venv/sbom.cdx.json), written beside it from the same locks
.venv/bin/python images/sbom.py --flavour cpu --commit "$commit" --out dist/sbom/stage-cpu.cdx.json
[ "${SKIP_RUN:-0}" = 1 ] || .venv/bin/python images/check_image.py --image "$IMAGE"
