#!/usr/bin/env bash
set -u
if [[ "${HOSTNAME:-}" == "trtllm-0" ]]; then
  exec curl -fsS -o /dev/null --max-time 4 http://127.0.0.1:8000/health
fi
re='[t]rtllm-serve serve'
for f in /proc/[0-9]*/cmdline; do
  cmd="$(tr '\0' ' ' < "$f" 2>/dev/null)" || continue
  if [[ "${cmd}" =~ ${re} ]]; then
    exit 0
  fi
done
exit 1
