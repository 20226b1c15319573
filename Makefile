# Two commands from a fresh clone: `make demo` and `make test`.
# On a machine that already has the dependencies (e.g. the GPU box), use its Python instead of a
# virtual environment:  make demo SYSTEM_PYTHON=1  (installs tiledsl with --no-deps).
PYTHON ?= python3
VENV   ?= .venv
SPECS  ?= $(wildcard specs/*.tile)
DEFAULT_SPEC ?= specs/hopper_d128_causal.tile

ifeq ($(SYSTEM_PYTHON),1)
PY := $(PYTHON)
SETUP := .setup-system
else
PY := $(VENV)/bin/python
SETUP := $(VENV)/.installed
endif
TILEDSL := $(PY) -m tiledsl.cli

.PHONY: demo test gpu-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

.setup-system:
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .

demo: $(SETUP)
	$(TILEDSL) check $(SPECS)
	$(TILEDSL) explain $(DEFAULT_SPEC) --seqlen 4096 --html out/$(basename $(notdir $(DEFAULT_SPEC))).html
	$(TILEDSL) compile $(SPECS) -o out/generated
	@if $(PY) -c 'import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0' 2>/dev/null; then \
		$(TILEDSL) run $(DEFAULT_SPEC) --seqlen 1000 --batch 2 --heads 4 && \
		$(TILEDSL) bench $(DEFAULT_SPEC) --seqlen 4096 --against sdpa; \
	else echo "no GPU (or no CuPy): skipping run and bench"; fi

test: $(SETUP)
	$(PY) -m pytest -q

gpu-test: $(SETUP)
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache
