# Two commands from a fresh clone: `make demo` and `make test`.
# On a machine that already has the dependencies (e.g. the GPU box), use its Python instead of a
# virtual environment:  make demo SYSTEM_PYTHON=1  (installs tiledsl with --no-deps).
PYTHON ?= python3
VENV   ?= .venv
SPECS  ?= $(wildcard specs/*.tile)
DEFAULT_SPEC ?= specs/hopper_d128_causal.tile
# Where `nvidia-smi -L` lists a GPU the venv also gets the GPU extras: CuPy to run kernels, PyTorch for
# bf16 inputs and the SDPA peers (tens of MB to GBs: only where they can run).
, := ,
HAS_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo 1)
EXTRAS  := $(if $(HAS_GPU),test$(,)gpu$(,)bench,test)
DEMO_OUT ?= out/generated
DEMO_HTML ?= out/$(basename $(notdir $(DEFAULT_SPEC))).html

ifeq ($(SYSTEM_PYTHON),1)
PY := $(PYTHON)
SETUP := .setup-system
else
PY := $(VENV)/bin/python
SETUP := $(VENV)/.installed
endif
TILEDSL := $(PY) -m tiledsl

.PHONY: demo test gpu-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	@echo "installing tiledsl[$(EXTRAS)]$(if $(HAS_GPU),, (no NVIDIA GPU: nvidia-smi lists none, so no CuPy or PyTorch; run and bench are skipped))"
	$(VENV)/bin/python -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

.setup-system:
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .

# Every step prints a summary (each command's --verbose / --all gives the rest): under 60 lines.
demo: $(SETUP)
	@echo "== check every bundled spec"
	@$(TILEDSL) check $(SPECS)
	@echo "== explain $(DEFAULT_SPEC) (the full explanation: tiledsl explain $(DEFAULT_SPEC))"
	@$(TILEDSL) explain $(DEFAULT_SPEC) --seqlen 4096 --summary --html $(DEMO_HTML)
	@echo "== compile every bundled spec to CUDA"
	@$(TILEDSL) compile $(SPECS) -o $(DEMO_OUT)
	@if $(PY) -c 'import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0' 2>/dev/null; then \
		echo "== run and validate $(DEFAULT_SPEC), then time it next to PyTorch SDPA"; \
		$(TILEDSL) run $(DEFAULT_SPEC) --seqlen 1000 --batch 2 --heads 4 && \
		$(TILEDSL) bench $(DEFAULT_SPEC) --seqlen 4096 --against sdpa; \
	else echo "== no usable GPU (or no CuPy): skipping run and bench"; fi

test: $(SETUP)
	$(PY) -m pytest -q

gpu-test: $(SETUP)
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache
