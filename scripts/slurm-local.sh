#!/usr/bin/env bash
# A real Slurm (slurmctld + two slurmd) on one host, for the multi-node tests.
#
#   scripts/slurm-local.sh install   install Debian's slurm-wlm and munge when missing
#   scripts/slurm-local.sh check     exit 0 when both are installed, 1 otherwise
#
# The cluster itself is started and stopped by tests/slurmlocal.py (LocalSlurm), with every
# daemon, socket and state folder under the test's own working directory: nothing here starts
# a service, and the Debian packages' own munge/slurm services are left disabled.
#
# Idempotent: when slurmctld, slurmd, srun and munged are already on PATH it only says so.
# `apt-get update` runs only when a plain install fails (a fresh image has no package lists).
set -euo pipefail

PROG=scripts/slurm-local.sh
PACKAGES=(slurm-wlm munge)
COMMANDS=(slurmctld slurmd srun sbatch squeue scancel scontrol sinfo munged)

usage() {
  echo "usage: $PROG install|check" >&2
  exit 2
}

installed() {
  local c
  for c in "${COMMANDS[@]}"; do
    PATH="$PATH:/usr/sbin:/sbin" command -v "$c" >/dev/null 2>&1 || return 1
  done
}

sudo_if_needed() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_install() {
  # policy-rc.d 101: the packages' postinst must not start munge/slurm services of their own.
  local policy=/usr/sbin/policy-rc.d made_policy=0 rc=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | sudo_if_needed tee "$policy" >/dev/null
    sudo_if_needed chmod 755 "$policy"
    made_policy=1
  fi
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" || rc=$?
  if [ "$made_policy" -eq 1 ]; then sudo_if_needed rm -f "$policy"; fi
  return "$rc"
}

cmd_install() {
  if installed; then
    echo "$PROG: slurm-wlm and munge already installed ($(slurm_version))"
    return 0
  fi
  if ! apt_install; then
    echo "$PROG: apt-get install failed; running apt-get update and retrying" >&2
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get update -q
    apt_install
  fi
  installed || { echo "$PROG: installed, but some of ${COMMANDS[*]} is still missing" >&2; exit 1; }
  echo "$PROG: installed $(slurm_version)"
}

slurm_version() {
  # `sinfo --version` needs a slurm.conf; the daemons' -V does not.
  PATH="$PATH:/usr/sbin:/sbin" slurmd -V 2>/dev/null || echo "slurm (version unknown)"
}

case "${1:-}" in
  install) cmd_install ;;
  check) installed ;;
  *) usage ;;
esac
