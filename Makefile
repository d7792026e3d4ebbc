# Two entry points, each sets up .venv itself on a fresh machine:
#   make demo   the main job: bertopt tune on the bundled MiniLM (the default recipe), artifacts/minilm-tuned
#   make test   the whole test suite (slow integration tests included)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.bertopt-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: demo test test-fast lint bench venv peer-venv clean

venv: $(STAMP)

# torch==2.13.0 first: it is the CPU wheel on disk; letting a dependency pick torch can pull a CUDA build.
$(STAMP): pyproject.toml requirements-real-models.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[all,dev]'
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-real-models.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/bertopt run recipes/minilm-tuned.yaml --out artifacts

# two pytest-xdist workers, whole files each (module fixtures build once), the long files first (tests/conftest.py):
# the serial suite keeps 2 cores only ~60% busy, waiting on processes, sockets and the JVM. TEST_WORKERS=0: serial.
# Each worker's bertopt runs with its share of the cores (BERTOPT_THREADS, set in tests/conftest.py).
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST)

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_recipes.py

# the separate venv of sentence-transformers' OpenVINO contenders (benchmarks/compare.py --st-peers)
peer-venv:
	benchmarks/peer-venv.sh peer-venv

clean:
	rm -rf artifacts build *.egg-info
