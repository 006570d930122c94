#!/bin/bash
# The node probe: the facts the local place reads, one `probe:<key>=<value>` line each.
set -u
say() { printf 'probe:%s=%s\n' "$1" "$2"; }
say node "${SLURMD_NODENAME:-?}"
say node_id "${SLURM_NODEID:-?}"
say hostname "$(uname -n)"
say cpu_cores "$(grep -c '^processor' /proc/cpuinfo)"
say cpu_model "$(sed -n 's/^model name[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo | head -n 1)"
grep -E '^(MemTotal|HugePages_Total|Hugepagesize):' /proc/meminfo | while IFS= read -r line; do
  say meminfo "$line"
done
for dev in /sys/class/infiniband/*; do
  [ -e "$dev" ] || continue
  driver="$(sed -n 's/^DRIVER=//p' "$dev/device/uevent" 2>/dev/null)"
  say rdma "${dev##*/} ${driver:-?}"
done
if [ -r /sys/module/gdrdrv/version ]; then
  say gdrdrv "$(cat /sys/module/gdrdrv/version)"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits \
    | while IFS= read -r line; do say gpu "$line"; done
fi
say end ok
