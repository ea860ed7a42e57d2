#!/usr/bin/env bash
# Makes a Debian bookworm image with Python 3.11 for docker/Dockerfile's PYTHON_IMAGE build argument,
# for hosts that cannot pull python:3.11-slim-bookworm from a registry (offline, or behind a proxy
# that only lets a Debian mirror through):
#   docker/debootstrap-base.sh [TAG]          (default TAG: mmad-base:bookworm; needs root)
#   docker build -f docker/Dockerfile --build-arg PYTHON_IMAGE=mmad-base:bookworm -t mmad:cpu .
# The mirror is the one this machine's apt uses (MMAD_DEBIAN_MIRROR overrides it). The image trusts
# the CA certificates this machine trusts, so pip inside a build works behind the same TLS proxy
# the host goes through. A run does nothing when TAG already exists (MMAD_BASE_FORCE=1 remakes it).
set -euo pipefail
tag="${1:-mmad-base:bookworm}"

if [ "${MMAD_BASE_FORCE:-0}" != 1 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "debootstrap-base: $tag already exists"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap-base: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "debootstrap-base: debootstrap needs root" >&2; exit 1; }

mirror="${MMAD_DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
  # the first Debian archive (not security) among the enabled one-line and deb822 source files
  # (cat fails on the patterns that match nothing; what it did read is enough)
  mirror=$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null || true; } \
    | awk '$1 == "deb" || $1 == "URIs:" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\/[^ ]*\/debian\/?$/) { print $i; exit } }')
fi
: "${mirror:?debootstrap-base: no Debian mirror found in /etc/apt; set MMAD_DEBIAN_MIRROR}"

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "debootstrap-base: bookworm from $mirror"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >/dev/null
# the Dockerfile adds bookworm-backports from this file's mirror, as on the python image
printf 'Types: deb\nURIs: %s\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
  "$mirror" > "$root/etc/apt/sources.list.d/debian.sources"
rm -f "$root/etc/apt/sources.list"
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin

# PIP_CERT: the venv's pip reads the system bundle (with the host's CAs) instead of its own copy
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$tag" >/dev/null
echo "debootstrap-base: made $tag ($(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=iec))"
