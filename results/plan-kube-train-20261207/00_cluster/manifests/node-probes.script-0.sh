#!/usr/bin/env sh
set -eu
root="${HOST_ROOT:-/host}"
echo "guide-probe node=${NODE_NAME:-unknown}"
f="$root/sys/module/gdrdrv/version"
if [ -e "$f" ]; then
  v=""
  read -r v < "$f" || true
  echo "guide-probe gdrdrv=${v:-unreadable}"
else
  echo "guide-probe gdrdrv=absent"
fi
efa=""
for d in "$root"/sys/class/infiniband/*; do
  [ -r "$d/device/uevent" ] || continue
  if grep -qx 'DRIVER=efa' "$d/device/uevent"; then
    efa="${efa:+$efa,}${d##*/}"
  fi
done
echo "guide-probe efa=${efa:-none}"
total=absent
size=absent
while read -r key value _; do
  case "$key" in
    HugePages_Total:) total="$value" ;;
    Hugepagesize:) size="$value" ;;
  esac
done < "$root/proc/meminfo"
echo "guide-probe hugepages_total=$total"
echo "guide-probe hugepagesize_kb=$size"
f="$root/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"
n=absent
if [ -r "$f" ]; then
  read -r n < "$f" || true
fi
echo "guide-probe hugepages_2mi=${n:-absent}"
echo "guide-probe end"
