#!/usr/bin/env bash
# Keep the recorded GPU runs out of what a lent GPU machine receives, and put them back.
#
#   scripts/device-light.sh on    before the device calls of a session
#   scripts/device-light.sh off   after them (also safe to run when already off)
#   scripts/device-light.sh status
#
# Why: the lent machines (the project's H200s) receive a copy of the working tree, tracked
# files included, with at most 64 MiB per call, carried wheels and site folders counted in.
# The committed GPU runs (results/gpu-*) are evidence the machine never needs, and they grew
# to most of that limit. `on` removes them from the index only (the files stay on disk, and
# in every commit) and ignores them through .git/info/exclude, so they neither travel nor show
# as untracked; `off` restores the index from HEAD and drops the exclude line. A run recorded
# meanwhile says `dirty` in its run.json (the machine's copy lacks those files): its notes say
# why. `on` refuses when anything is staged, so `off` can restore the index from HEAD without
# losing work; nothing is committed by either.
set -euo pipefail
PROG=scripts/device-light.sh
PATTERN='results/gpu-*/*'  # the run folders; their small .notes.md beside them stay
EXCLUDE_LINE='/results/gpu-*/'
MARK='# scripts/device-light.sh on'

top=$(git rev-parse --show-toplevel)
cd "$top"
exclude=$(git rev-parse --git-path info/exclude)

state() {
  if grep -qxF "$MARK" "$exclude" 2>/dev/null; then echo on; else echo off; fi
}

case "${1:-}" in
  on)
    if [[ $(state) == on ]]; then echo "$PROG: already on"; exit 0; fi
    if ! git diff --cached --quiet; then
      echo "$PROG: refused: the index holds staged changes (commit or unstage them first;" \
           "'off' restores the index from HEAD)" >&2
      exit 2
    fi
    mkdir -p "$(dirname "$exclude")"
    printf '%s\n%s\n' "$MARK" "$EXCLUDE_LINE" >> "$exclude"
    git ls-files -z -- "$PATTERN" | xargs -0 -r git rm -q --cached --
    echo "$PROG: on (commit nothing until off): $(git ls-files -- "$PATTERN" | wc -l) files of $PATTERN tracked (files kept" \
         "on disk); the working tree that travels: $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes"
    ;;
  off)
    if [[ $(state) == off ]]; then echo "$PROG: already off"; exit 0; fi
    git reset -q -- "$PATTERN" 2>/dev/null || git reset -q
    tmp=$(mktemp)
    grep -vxF -e "$MARK" -e "$EXCLUDE_LINE" "$exclude" > "$tmp" || true
    cat "$tmp" > "$exclude" && rm -f "$tmp"
    echo "$PROG: off: $(git ls-files -- "$PATTERN" | wc -l) files of $PATTERN tracked again"
    ;;
  status)
    echo "$PROG: $(state)"
    ;;
  *)
    echo "usage: $PROG on|off|status" >&2
    exit 2
    ;;
esac
