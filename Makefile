# Two entry points for a newcomer: `make test` and `make demo`. Both build their own venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The mlx[cpu] wheel ships a slow reference BLAS; Debian's OpenBLAS speeds fp32 up a lot when present.
OPENBLAS := $(wildcard /usr/lib/x86_64-linux-gnu/libopenblas.so.0)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test demo venv clean bench

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,demo,vision]'
	touch $(STAMP)

test: $(STAMP)
	LD_PRELOAD=$(OPENBLAS) $(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	LD_PRELOAD=$(OPENBLAS) $(PY) -m provider.demo

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
