# torchrec-pgas: `make demo` runs the main job, `make test` the tests (README).
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed
BUILT := $(VENV)/.torchrec-pgas-built
export TORCH_CUDA_ARCH_LIST ?= 9.0a
export NCCL_NVLS_ENABLE := 0
export TORCH_SYMM_MEM_DISABLE_MULTICAST := 1
export NVSHMEM_DISABLE_NVLS := 1

.PHONY: demo test build clean

$(DEPS): scripts/install_deps.sh
	bash scripts/install_deps.sh $(VENV)
	touch $@

# Builds the CUDA extension too when nvcc is on PATH (it compiles without a GPU).
$(BUILT): $(DEPS) setup.py $(wildcard csrc/*)
	MAX_JOBS=$${MAX_JOBS:-2} $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(BUILT)

demo: $(BUILT)
	$(PY) examples/demo.py

test: $(BUILT)
	$(PY) -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests

clean:
	rm -rf build *.egg-info torchrec_pgas/_C*.so $(BUILT)
