# Two entry points, each builds .venv from nothing on a fresh machine:
#   make demo   run the bundled Megatron recipe in a 1,024-rank virtual world (one sandbox rank)
#   make test   run the test suite
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU build on local disk, never a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/prism-launch --nnodes 128 --nproc-per-node 8 \
	    device=cpu sandbox.ranks=[1000] trace.dir=prism_traces/demo \
	    examples/megatron_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) prism_traces
