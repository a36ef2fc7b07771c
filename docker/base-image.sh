#!/usr/bin/env bash
# A Python base image made on this machine, for building the images where no container registry can be reached
# (Debian's packages and PyPI can, directly or through a mirror or proxy): Debian bookworm by debootstrap (minbase)
# with python3, venv and the CA certificates, imported as a stand-in for python:3.12-slim. Pass it to the build
# with `--build-arg PYTHON_IMAGE=elmo-python:bookworm` (README, "Docker and compose": building offline).
#
#   docker/base-image.sh [ENGINE]     ENGINE: podman (default when it is installed) or docker; needs root
#
# Environment: BASE_TAG (default elmo-python:bookworm), DEBIAN_MIRROR (default http://deb.debian.org/debian: the
# mirror apt uses here, if it names another). The certificates this host added to its trust store
# (/usr/local/share/ca-certificates: a proxy's or a mirror's own CA) are trusted inside too, and pip inside reads
# the system store, so that the image reaches PyPI the way this host does.
set -euo pipefail

die() {
    echo "base-image.sh: $*" >&2
    exit 2
}

engine="${1:-$(command -v podman >/dev/null && echo podman || echo docker)}"
tag="${BASE_TAG:-elmo-python:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
[ "$(id -u)" = 0 ] || die "debootstrap needs root"
command -v debootstrap >/dev/null || die "debootstrap is missing (apt-get install debootstrap)"

root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror"
shopt -s nullglob
added=(/usr/local/share/ca-certificates/*.crt)
if [ ${#added[@]} -gt 0 ]; then
    cp "${added[@]}" "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
fi
# pip's own certificate bundle knows no CA this host added: read the system store instead.
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$root/etc/pip.conf"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
tar -C "$root" -c . | "$engine" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$tag" >/dev/null
echo "base-image.sh: $tag (Debian bookworm, $(chroot "$root" python3 --version)) in $engine"
