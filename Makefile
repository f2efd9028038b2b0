# Two entry points: `make demo` (the main job) and `make test`; both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test selfcheck zoo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0: where pip's find-links hold a local CPU wheel of torch 2.13.0 (the dev machine's
	# /opt/wheels), that wheel is found first and the venv gets the CPU build (2.13.0+cpu, a few hundred MB).
	# Elsewhere the same pin resolves on PyPI to the CUDA build with its CUDA libraries (several GB);
	# for a CPU-only venv there, install torch from PyTorch's CPU index into .venv first (README, "Install"):
	# .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
	# triton==3.9.0: the newest tested triton, for its CPU interpreter (the GPU image runs the oldest
	# tested one, 3.6, natively).
	$(BIN)/pip install -q torch==2.13.0 triton==3.9.0
	# [cpu]: numba, the compiled CPU backend the canary picks on the CPU (~6x less host time than torch).
	$(BIN)/pip install -q -e '.[cpu,triton,transformers,test]' transformers==5.25.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvcanary demo

# Two test processes by default (pytest-xdist): the suite took 11 min 56 s in one process on the 2-core dev
# CPU and 7 min 26 s in two; TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(PYTEST_ARGS)

selfcheck: $(STAMP)
	$(BIN)/kvcanary selfcheck

zoo: $(STAMP)
	$(BIN)/kvcanary zoo

clean:
	rm -rf $(VENV)
