# torchrec-pgas: `make demo` runs the main job, `make test` the tests (README).
# STACK picks the torch / FBGEMM / TorchRec stack, torchrec_pgas/stacks/torchrec-$(STACK).txt:
# 1.6 (the default) in .venv, another in .venv-$(STACK): `make test STACK=1.9`.
# PYTEST_ARGS adds pytest arguments: `make test PYTEST_ARGS="-m stacks"` runs the slice CI runs on other stacks.
STACK ?= 1.6
PYTEST_ARGS ?=
VENV ?= $(if $(filter 1.6,$(STACK)),.venv,.venv-$(STACK))
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed
BUILT := $(VENV)/.torchrec-pgas-built
# The in-place extension serves one venv at a time: a build for another removes this mark,
# so that switching stacks rebuilds it.
EXT_FOR := build/.extension-for-$(notdir $(VENV))
export TORCH_CUDA_ARCH_LIST ?= 9.0a
export NCCL_NVLS_ENABLE := 0
export TORCH_SYMM_MEM_DISABLE_MULTICAST := 1
export NVSHMEM_DISABLE_NVLS := 1

.PHONY: demo test build clean

$(DEPS): scripts/install_deps.sh torchrec_pgas/stacks/torchrec-$(STACK).txt setup.py
	bash scripts/install_deps.sh $(VENV) $(STACK)
	touch $@

$(EXT_FOR):

# Builds the CUDA extension too when nvcc is on PATH (it compiles without a GPU).
$(BUILT): $(DEPS) setup.py $(wildcard csrc/*) $(EXT_FOR)
	rm -f build/.extension-for-*
	MAX_JOBS=$${MAX_JOBS:-2} $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	mkdir -p build && touch $(EXT_FOR) $@

build: $(BUILT)

demo: $(BUILT)
	$(PY) examples/demo.py

test: $(BUILT)
	$(PY) -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning $(PYTEST_ARGS) tests

clean:
	rm -rf build *.egg-info torchrec_pgas/_C*.so $(BUILT)
