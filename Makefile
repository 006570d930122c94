# The README's two commands: `make run` and `make test`. Everything they need is installed here.
SHELL := /bin/bash
PY_BASE ?= python3
VENV := .venv
PY := $(VENV)/bin/python
AIPERF_VENV := .venv-aiperf
RUN ?=
# the context `make run` runs on (local: this machine; kube or slurm: that cluster, refused as a
# FAIL at 00 when it does not answer); empty: the cluster profile's (lib/stages/profile.py), else local
CONTEXT ?=
REFERENCE := $(shell cat results/REFERENCE 2>/dev/null)
PIP_QUIET := -q --disable-pip-version-check

.PHONY: run test book venv unit cluster-tests nbval reference kube-plane slurm chromium rerecord results-size

# The guide's venv. torch==2.13.0 first: it is the CPU build on this machine's disk, and anything
# that asks for torch more loosely pulls a multi-GB CUDA build (TOOLCHAIN.md).
$(VENV)/.installed: requirements.txt pyproject.toml
	@# GNU patch: lib/site_patches applies the project's pinned vLLM patch (tests run it for real)
	command -v patch >/dev/null || apt-get install -y -qq patch || { apt-get update -qq && apt-get install -y -qq patch; }
	test -x $(PY) || $(PY_BASE) -m venv $(VENV)
	$(PY) -m pip install $(PIP_QUIET) torch==2.13.0 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
	$(PY) -m pip install $(PIP_QUIET) -r requirements.txt 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
	$(PY) -m pip install $(PIP_QUIET) --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
	touch $@

# AIPerf apart: its pins (pandas~=2.3.3, ...) fight the book stack's pandas 3.1.1.
$(AIPERF_VENV)/.installed: requirements-aiperf.txt
	test -x $(AIPERF_VENV)/bin/python || $(PY_BASE) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install $(PIP_QUIET) -r requirements-aiperf.txt 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
	touch $@

venv: $(VENV)/.installed $(AIPERF_VENV)/.installed

# The whole guide on the local context, into a new results/<run_id>/, then the book from it.
# RUN=<run_id> resumes that run: stages with intact gates and hashes kept, the rest redone.
# Ctrl-C (SIGINT to the group) or SIGTERM stops every process the guide started (lib.runner).
run: venv
	$(PY) -m lib.runner run $(if $(CONTEXT),--context $(CONTEXT)) $(if $(RUN),--run-id $(RUN))

# Prints its wall time (issue 40's bound: 20 s on a 2-core machine after `make run`).
book: venv
	@test -n "$(RUN)" || { echo "usage: make book RUN=<run_id> (a folder of results/)"; exit 2; }
	@start=$$(date +%s%N); $(PY) -m lib.runner book $(RUN); rc=$$?; \
	  ms=$$(( ($$(date +%s%N) - start) / 1000000 )); \
	  echo "make book: $$(( ms / 1000 )).$$(( ms % 1000 / 100 )) s wall (exit $$rc)"; exit $$rc

# Store a recorded run as the committed reference (notebooks/ carry its outputs).
reference: venv
	@test -n "$(RUN)" || { echo "usage: make reference RUN=<run_id>"; exit 2; }
	$(PY) -m lib.runner reference $(RUN)

# Re-record the cheap runs (the CPU reference, the control-plane, Slurm and plan runs) and
# replace them in the tree, after a change that alters what the stages call (tests/rerecord.py;
# DESIGN.md, Reference runs age). `make rerecord KINDS="kube-ctlplane plan-kube-train"` for some.
rerecord: venv kube-plane slurm
	$(PY) -m tests.rerecord $(KINDS)

# What results/ holds checked out (files, MiB, runs).
results-size: venv
	@$(PY) -c "from lib.publish.catalog import results_size; print(results_size('results'))"

# A real Kubernetes control plane (kube-apiserver, scheduler, controller-manager 1.20.2 from
# Debian's source package, etcd), built once into ~/.cache (about 12 min on 2 cores); then
# `scripts/kube-plane.sh build` returns at once. The kube-context tests start it on 127.0.0.1.
kube-plane:
	scripts/kube-plane.sh build

# A real two-node Slurm on this host (Debian's slurm-wlm and munge) for the slurm tests.
slurm:
	scripts/slurm-local.sh install

# Debian's headless Chromium and chromedriver for tests/test_book_browser.py; returns at once
# when both are installed.
chromium:
	scripts/chromium.sh install

# The slowest tests are printed (--durations): `make test` must stay under 20 minutes here.
# `unit` is everything but the cluster tests on three workers, a file at a time, the longest
# first (pytest-xdist; the tests wait on servers, AIPerf's start-up and kernels as much as they
# compute), then the cluster tests on one (tests/conftest.py says why).
UNIT_TESTS := REPRO_BROWSER_REQUIRED=1 $(PY) -m pytest -q -n 3 --dist loadfile \
  --no-loadscope-reorder -m "not cluster" --durations=25 tests
# Each phase prints its wall time (the 20-minute budget is read from these lines).
unit: venv kube-plane slurm chromium
	@start=$$(date +%s); $(UNIT_TESTS); rc=$$?; \
	  echo "make test: unit phase $$(( $$(date +%s) - start )) s wall (exit $$rc)"; exit $$rc
	$(MAKE) --no-print-directory cluster-tests

# The cluster files as three pytest processes side by side, one worker each: the kube files,
# the kube serving A/B on two nodes, LeaderWorkerSet and faults (marked `cluster_c`), and the
# Slurm files (marked `cluster_b`, tests/conftest.py); they share no daemon, port or file (each kube
# module starts its own control plane on free ports); each line is prefixed with its group,
# each prints its own durations, and the phase fails if any does. Each group's output is kept
# in a file too, and the short summary of every group that failed is printed again at the end:
# interleaved, a failure of the group that ended first scrolled out of a log's tail (CI).
CLUSTER_TESTS := $(PY) -m pytest -q -p no:cacheprovider --durations=10 -rfE tests -m
cluster-tests: venv kube-plane slurm
	@set -o pipefail; start=$$(date +%s); logs=$$(mktemp -d); \
	  { $(CLUSTER_TESTS) "cluster and not cluster_b and not cluster_c" 2>&1 \
	    | sed -u 's/^/[kube] /' | tee $$logs/kube; } & kube=$$!; \
	  { $(CLUSTER_TESTS) "cluster and cluster_c" 2>&1 | sed -u 's/^/[kube-ab+faults] /' \
	    | tee $$logs/kube-ab+faults; } & kube_ab=$$!; \
	  $(CLUSTER_TESTS) "cluster and cluster_b" 2>&1 | sed -u 's/^/[slurm] /' | tee $$logs/slurm; \
	  slurm_rc=$$?; wait $$kube; kube_rc=$$?; wait $$kube_ab; kube_ab_rc=$$?; \
	  for group in kube kube-ab+faults slurm; do \
	    grep -q "short test summary info" $$logs/$$group || continue; \
	    sed -n '/= FAILURES =/,/slowest 10 durations/p' $$logs/$$group | tail -60; \
	    sed -n '/short test summary info/,$$p' $$logs/$$group; done; rm -rf $$logs; \
	  rc=$$(( kube_rc || kube_ab_rc || slurm_rc )); \
	  echo "make test: cluster phase $$(( $$(date +%s) - start )) s wall" \
	    "(exit $$rc: kube $$kube_rc, kube-ab+faults $$kube_ab_rc, slurm $$slurm_rc)"; exit $$rc

# Strict nbval (never --nbval-lax): the committed notebooks re-executed against their evidence,
# and the replayable notebooks of the further reference runs (results/REPLAYED), each against
# its own run; three runs at a time (each a pytest of its own: REPRO_REPLAY names its run), each
# line prefixed with its run, the phase failing if any run does.
NBVAL := $(PY) -m pytest -q -p no:cacheprovider --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg
nbval: venv
	@test -n "$(REFERENCE)" || { echo "results/REFERENCE names no reference run"; exit 2; }
	@start=$$(date +%s); \
	{ echo "$(REFERENCE) notebooks/"; for run in $$(cut -d/ -f2 results/REPLAYED | sort -u); do \
	    echo "$$run" $$(grep "^results/$$run/" results/REPLAYED); done; } \
	  | xargs -P 3 -L 1 bash -c 'set -o pipefail; REPRO_REPLAY=results/$$0 $(NBVAL) "$$@" 2>&1 \
	      | sed -u "s|^|[$$0] |"'; rc=$$?; \
	echo "make test: nbval phase $$(( $$(date +%s) - start )) s wall (exit $$rc)"; \
	$(PY) -c "from lib.core.stage import remove_orphan_shadows as r; print('removed', len(r()), 'replay copies left by stopped kernels')"; \
	$(MAKE) --no-print-directory results-size; exit $$rc

# The cluster tests alone, then nbval: beside nbval a kube serve missed its deadline once in
# three runs (test_06_ep_num_comms_arms..., its 04 FAILed under the load; it passes alone).
test: venv unit nbval
