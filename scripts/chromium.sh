#!/usr/bin/env bash
# Debian's headless Chromium and its chromedriver, for the book's browser tests
# (tests/test_book_browser.py drives /usr/bin/chromium through /usr/bin/chromedriver).
#
#   scripts/chromium.sh install   install Debian's chromium and chromium-driver when missing
#   scripts/chromium.sh check     exit 0 when both are installed, 1 otherwise
#
# Debian's packages, never a browser a tool downloads for itself: this machine reaches no
# download site but Debian's and PyPI's, and Selenium Manager or Playwright would try.
#
# Idempotent: when /usr/bin/chromium and /usr/bin/chromedriver are there it only says so.
# `apt-get update` runs only when a plain install fails (a fresh image has no package lists).
# --no-install-recommends: the one recommend, chromium-sandbox, is the setuid sandbox that the
# tests turn off (--no-sandbox: they run as root in a container).
set -euo pipefail

PROG=scripts/chromium.sh
PACKAGES=(chromium chromium-driver)
BINARIES=(/usr/bin/chromium /usr/bin/chromedriver)

usage() {
  echo "usage: $PROG install|check" >&2
  exit 2
}

installed() {
  local b
  for b in "${BINARIES[@]}"; do
    [ -x "$b" ] || return 1
  done
}

sudo_if_needed() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_install() {
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"
}

chromium_version() {
  /usr/bin/chromium --version 2>/dev/null || echo "chromium (version unknown)"
}

cmd_install() {
  if installed; then
    echo "$PROG: chromium and chromedriver already installed ($(chromium_version))"
    return 0
  fi
  if ! apt_install; then
    echo "$PROG: apt-get install failed; running apt-get update and retrying" >&2
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_install
  fi
  installed || { echo "$PROG: installed, but ${BINARIES[*]} is still incomplete" >&2; exit 1; }
  echo "$PROG: installed $(chromium_version)"
}

case "${1:-}" in
  install) cmd_install ;;
  check) installed ;;
  *) usage ;;
esac
