# Two entry points, each working on a fresh machine with Python 3.11+ and pip:
#   make demo   creates .venv, trains a tiny latent thought model on the embedded corpus (configs/tiny_ltm.py),
#               prints its evaluation (what z is worth included) and a sample generated under z inferred from the
#               prompt
#   make test   creates .venv with the dev extras (and .venv-aot, see below) and runs the test suite but the tests
#               marked `long` (notebooks, benchmark dry runs, several processes, simulated devices: a minute or
#               more each on 2 cores)
#   make test-long  runs the `long` tests; .ci/run runs `make test` and then this
# and one more:
#   make gpu-aot  compiles every Pallas kernel and the models' train steps and generation for an H100 without a GPU
#                 (benchmarks/gpu_aot.py) and writes benchmarks/results/gpu-aot-h100.json
#   make bench-gpu  every benchmark sweep on this machine's GPU, peers included where importable
#                 (benchmarks/gpu_sweep.py): benchmarks/results/*-<device>.json and gpu-sweep-<device>.json.
#                 SWEEP_ARGS splits it into commands under 10 minutes: "--part N" (1-4, see --list) or
#                 "--resume --deadline 560" repeated; SWEEP_ARGS=--quick is the CPU dry run (~4-5 min on 2 cores).
#                 The venv's Python when there is one, else python3 (a GPU image's, which holds CUDA jax): no
#                 install step, since the GPU machines have no network and .venv holds CPU jax.
#   make test-gpu  the test suite on this machine's GPU, offline: a venv over the GPU image's Python (GPU_PYTHON,
#                 which holds CUDA jax; the image's packages stay visible) with the wheels of WHEELS_DIR for what the
#                 image lacks (`python benchmarks/peers.py --download .whl --wheels suite` with network, then carry
#                 .whl/ there) and the project installed editable, then pytest (the `gpu` marker's tests run the
#                 compiled kernels). GPU_PYTEST_ARGS narrows it, e.g. "-m gpu". Without a GPU it says so and fails.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WORKDIR ?= runs/tiny-ltm
PYTEST_WORKERS ?= 2
# The converter test runs the official RWKV code, which needs torch: install a CPU build first so the `convert`
# extra (torch>=2.4) is already satisfied and never pulls the multi-GB CUDA wheels. The pinned CPU wheel comes from a
# local wheelhouse when pip has one, else from PyTorch's CPU index.
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# The deviceless GPU compile check runs in a venv of its own: with the CUDA plugin installed, a plain `import jax`
# tries to start it. jax 0.11.x, what the GPU machines run, needs Python 3.12; without a 3.12 (on PATH or under
# pyenv) the check uses jax 0.10.2 on $(PYTHON). nvidia-cuda-nvcc is only there for ptxas (registers and spills).
# A venv that cannot be built (no network, no wheels) is not an error: its test then skips, saying why.
AOT_VENV ?= .venv-aot
AOT_PYTHON312 := $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12; do \
  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$p; break; }; done)
ifneq ($(AOT_PYTHON312),)
AOT_PYTHON ?= $(AOT_PYTHON312)
AOT_JAX ?= 0.11.2
else
AOT_PYTHON ?= $(PYTHON)
AOT_JAX ?= 0.10.2
endif
AOT_NVCC ?= nvidia-cuda-nvcc==13.0.88
# tokamax (attention's impl="tokamax") and what it imports, pinned without their dependency resolution (which could
# move jax): the suite compiles its Mosaic GPU kernels for sm_90a and checks the mask mapping in this venv.
AOT_TOKAMAX ?= tokamax==0.0.17 einshape==1.0 qwix==0.1.8 immutabledict==4.3.1 pydantic==2.14.3 pydantic-core==2.50.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 xprof==2.24.2 fire==0.7.1 termcolor==3.3.0 jaxtyping==0.3.11 \
  wadler-lindig==0.1.8 six==1.17.0
AOT_PIP := $(AOT_VENV)/bin/python -m pip install -q --retries 1 --timeout 30

.PHONY: demo test test-long test-gpu test-gpu-venv gpu-aot bench-gpu clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q '$(TORCH_CPU)' || $(BIN)/python -m pip install -q torch --index-url $(TORCH_CPU_INDEX)
	$(BIN)/python -m pip install -q -e '.[dev,convert]'
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/ltm train --config configs/tiny_ltm.py --workdir $(WORKDIR)
	$(BIN)/ltm eval --workdir $(WORKDIR)
	$(BIN)/ltm generate --workdir $(WORKDIR) --prompt "The list" --max-new-tokens 300 --temperature 0.8 --top-p 0.95

# The project goes in editable and with its dependencies (the model cases import flax, optax, ...), next to the
# plugin of the same jax version. On failure the half-built venv is removed and the log kept for the test to cite.
$(AOT_VENV)/.installed: pyproject.toml
	@rm -rf $(AOT_VENV)
	@echo "building $(AOT_VENV): jax $(AOT_JAX) + CUDA 13 plugin on $(AOT_PYTHON) (log: $(AOT_VENV).log)"
	@{ $(AOT_PYTHON) -m venv $(AOT_VENV) \
	  && $(AOT_PIP) jax==$(AOT_JAX) jaxlib==$(AOT_JAX) jax-cuda13-plugin==$(AOT_JAX) jax-cuda13-pjrt==$(AOT_JAX) -e . \
	  && $(AOT_PIP) --no-deps $(AOT_NVCC) \
	  && { $(AOT_PIP) --no-deps $(AOT_TOKAMAX) || echo "tokamax not installed: its tests skip"; } \
	  && touch $@; } > $(AOT_VENV).log 2>&1 \
	  || { rm -rf $(AOT_VENV); echo "$(AOT_VENV) could not be built (see $(AOT_VENV).log): the GPU AOT test will skip"; }

test: $(VENV)/.installed-dev $(AOT_VENV)/.installed
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --durations=60 -m "not long"

test-long: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --durations=20 -m long

GPU_PYTHON ?= python3
GPU_VENV ?= .venv-gpu
WHEELS_DIR ?= .whl
GPU_WORKERS ?= 8
GPU_PYTEST_ARGS ?=
GPU_PIP := $(GPU_VENV)/bin/python -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check

# The venv is made over every site-packages folder on GPU_PYTHON's path (a .pth file: GPU_PYTHON may itself be a
# venv's, whose packages --system-site-packages would not see, over others named in .pth files); what it installs
# comes first. Every xdist worker shares the GPU, so none preallocates its memory. `make test-gpu-venv` is the
# offline install alone, which needs no GPU.
test-gpu:
	@backend=$$($(GPU_PYTHON) -c 'import jax; print(jax.default_backend())' 2>/dev/null); \
	  [ "$$backend" = gpu ] || { echo "test-gpu: no GPU here ($(GPU_PYTHON)'s jax backend: $${backend:-none, jax does not import}); run it on a GPU machine"; exit 1; }
	@$(MAKE) --no-print-directory test-gpu-venv
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(GPU_VENV)/bin/python -m pytest -q -n $(GPU_WORKERS) --durations=15 \
	  $(GPU_PYTEST_ARGS)

test-gpu-venv:
	rm -rf $(GPU_VENV)
	$(GPU_PYTHON) -m venv $(GPU_VENV)
	$(GPU_PYTHON) -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
	  > $$($(GPU_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/gpu-image.pth
	@if ls $(WHEELS_DIR)/*.whl >/dev/null 2>&1; then $(GPU_PIP) $(WHEELS_DIR)/*.whl; \
	  else echo "test-gpu: no wheels in $(WHEELS_DIR): tests that import what the image lacks will fail"; fi
	$(GPU_PIP) --no-build-isolation -e .

gpu-aot: $(AOT_VENV)/.installed
	@test -f $(AOT_VENV)/.installed || { echo "gpu-aot: no $(AOT_VENV); see $(AOT_VENV).log"; exit 1; }
	$(AOT_VENV)/bin/python benchmarks/gpu_aot.py --jobs $(PYTEST_WORKERS) --markdown

BENCH_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
SWEEP_ARGS ?=

bench-gpu:
	$(BENCH_PYTHON) benchmarks/gpu_sweep.py $(SWEEP_ARGS)

clean:
	rm -rf $(VENV) $(AOT_VENV) $(AOT_VENV).log $(GPU_VENV) runs
