# Two entry points, each builds .venv from nothing on a fresh machine:
#   make demo   run the bundled Megatron recipe in a 1,024-rank virtual world (one sandbox rank)
#   make test   run the test suite
# The venv is built with the newest supported Python found here (.ci/newest-python: 3.13,
# 3.12, then 3.11; pyenv's installed versions count); PYTHON=... overrides it.
# TORCH=... picks the torch release (default 2.13.0).
ifeq ($(origin PYTHON), undefined)
PYTHON := $(shell .ci/newest-python)
endif
TORCH  ?= 2.13.0
VENV   ?= .venv
DEMO_TRACE ?= prism_traces/demo
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { .ci/newest-python; echo "need Python 3.11-3.13 (set PYTHON=...)"; exit 1; }
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	@echo "building $(VENV) with $$($(PYTHON) -c 'import sys; print(sys.executable, sys.version.split()[0])'), torch $(TORCH)"
	$(PYTHON) -m venv --clear $(VENV)
	# torch first and pinned: for Python 3.11 the CPU build lies on local disk; for a newer
	# Python pip takes PyPI's build (with CUDA: about 2.8 GB of downloads)
	$(BIN)/pip install --quiet torch==$(TORCH)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/prism-launch --nnodes 128 --nproc-per-node 8 \
	    device=cpu sandbox.ranks=[1000] trace.dir=$(DEMO_TRACE) \
	    examples/megatron_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

# two workers (each test module on one of them), then the tests marked serial alone; the serial
# part runs whether or not the first failed, and the target fails if either did
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope -m "not serial"; \
	first=$$?; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m serial; \
	second=$$?; \
	test $$first -eq 0 && test $$second -eq 0

clean:
	rm -rf $(VENV) prism_traces
