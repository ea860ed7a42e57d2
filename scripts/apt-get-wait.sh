#!/usr/bin/env bash
# apt-get "$@" (as root), waiting for another package manager (unattended-upgrades, a second setup)
# to let go of apt's locks instead of failing at once: dpkg's lock through apt's own
# DPkg::Lock::Timeout, the package lists' and the download cache's, which apt-get does not wait
# for, by trying again every few seconds. MMAD_APT_LOCK_TIMEOUT: the seconds to wait (default 600).
set -uo pipefail
timeout_s="${MMAD_APT_LOCK_TIMEOUT:-600}"
deadline=$((SECONDS + timeout_s))
waiting=0
while :; do
  out=$(DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$timeout_s" "$@" 2>&1)
  rc=$?
  if [ "$rc" = 0 ]; then
    [ -z "$out" ] || printf '%s\n' "$out"
    exit 0
  fi
  if grep -q "Could not get lock" <<<"$out" && [ "$SECONDS" -lt "$deadline" ]; then
    [ "$waiting" = 1 ] || echo "setup: another package manager holds apt's lock; waiting up to ${timeout_s} s" >&2
    waiting=1
    sleep 2
    continue
  fi
  printf '%s\n' "$out" >&2
  exit "$rc"
done
