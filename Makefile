# Entry points, all self-contained from a fresh clone with only python3:
#   make train      - the main job on its default: `jshard train`, a sharded GPT run on 8 fake CPU devices
#   make test       - the test suite (8 fake CPU devices), what CI runs
#   make test-fast  - its fast tier (`pytest -m fast`): one case per strategy family, the checks, the planner
#   make coverage   - the suite with branch coverage of jshard/ (docs/testing.md)
#   make gpu-check  - on a GPU machine: the device tier of the tests there, then `jshard bench gpu`
#                     and `jshard bench kernels` (docs/benchmarks.md); DRY=1 runs the same path here with tiny models
#   make maxtext-compare - MaxText's 8B step beside jshard's, both compiled for 8 H100s here (not in CI;
#                     its own virtualenv, Python >= 3.12; docs/gpu-compile.md)
# The suite's seed is fixed; JSHARD_TEST_SEED=<int> replaces it to fuzz (pytest's header shows it).
# Another Python gets its own virtualenv, e.g. the newest JAX (which needs Python >= 3.12):
#   make test PYTHON=python3.12 VENV=.venv-py3.12
PYTHON ?= python3
VENV   ?= .venv
STAMP  := $(VENV)/.installed
# GPU_COMPILE=1: the virtualenv also gets XLA's GPU compiler, which needs no GPU: the CUDA plugin
# of the installed JAX's version and cuDNN (for its attention kernel), for `jshard compile`,
# `jshard plan --validate --target` and the gpu_compile tests (which skip without it).
GPU_COMPILE ?=
GPU_STAMP := $(VENV)/.gpu-compile
NEEDS     := $(STAMP) $(if $(GPU_COMPILE),$(GPU_STAMP))

.PHONY: train test test-fast coverage gpu-check maxtext-compare venv versions clean

# Re-install only when the package definition changes. --no-compile: Python compiles what is
# imported when it is first imported (6 s) instead of pip compiling every module installed (35 s).
PIP_INSTALL := $(VENV)/bin/python -m pip install --quiet --no-compile
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -e '.[test]'
	touch $(STAMP)

$(GPU_STAMP): $(STAMP)
	v=$$($(VENV)/bin/python -c 'import jax; print(jax.__version__)') && \
	$(PIP_INSTALL) "jax-cuda13-plugin==$$v" "jax-cuda13-pjrt==$$v" nvidia-cudnn-cu13
	touch $(GPU_STAMP)

venv: $(NEEDS)

train: $(STAMP)
	$(VENV)/bin/jshard train

# The versions under test come first, so every summary says what it tested.
versions: $(NEEDS)
	@$(VENV)/bin/python -c "import sys, jax, flax, optax, orbax.checkpoint as o; \
	import importlib.util as u; gpu = u.find_spec('jax_cuda13_plugin') or u.find_spec('jax_cuda12_plugin'); \
	print(f'python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}, orbax-checkpoint {o.__version__}, ' \
	      + ('XLA:GPU compiler ' + gpu.name if gpu else 'no GPU compiler (GPU_COMPILE=1 adds it)'))"

# The suite compiles far more than it runs, and one XLA compile keeps about one core busy:
# two pytest processes (pytest-xdist, each test file whole in one, so module fixtures are
# shared as in a serial run) take two thirds of the serial time on 2 cores. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
IN_WORKERS := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# PYTEST_ARGS: more of pytest's arguments (e.g. -m 'not slow', a file, -k).
PYTEST_ARGS ?=

test: versions
	$(VENV)/bin/python -m pytest $(IN_WORKERS) $(PYTEST_ARGS)

test-fast: versions
	$(VENV)/bin/python -m pytest -m fast $(IN_WORKERS)

# Branch coverage of jshard/ over the suite (or PYTEST_ARGS' part of it); subprocesses are not measured.
coverage: versions
	$(VENV)/bin/python -m pytest $(IN_WORKERS) --cov=jshard --cov-branch --cov-report=term:skip-covered $(PYTEST_ARGS)

# GPU_CHECK_PYTHON: a Python whose JAX sees the GPU (default: this virtualenv's); CASES: some of
# `jshard bench gpu`'s cases, comma-separated. Both parts run; the target fails if either did.
GPU_CHECK_PYTHON ?= $(VENV)/bin/python
GPU_CHECK_OUT    ?= out/gpu-check
CASES            ?=

gpu-check: $(if $(filter $(VENV)/bin/python,$(GPU_CHECK_PYTHON)),$(STAMP))
	mkdir -p $(GPU_CHECK_OUT)
	JSHARD_TEST_DEVICE=1 $(GPU_CHECK_PYTHON) -m pytest -m device -q -p no:cacheprovider \
	    --junitxml=$(GPU_CHECK_OUT)/tests.xml; tests=$$?; \
	$(GPU_CHECK_PYTHON) -m jshard.cli bench gpu --out $(GPU_CHECK_OUT) $(if $(DRY),--dry) \
	    $(if $(CASES),--cases $(CASES)); bench=$$?; \
	$(GPU_CHECK_PYTHON) -m jshard.cli bench kernels --json $(GPU_CHECK_OUT)/kernels.json $(if $(DRY),--dry); kernels=$$?; \
	exit $$(( tests || bench || kernels ))

clean:
	rm -rf $(VENV) .venv-py* .venv-hf .venv-maxtext build *.egg-info

# MaxText 0.2.5 in a virtualenv of its own: its accelerator-free requirements (they bring the JAX
# and Flax it is built on, inside jshard's ranges), XLA's GPU compiler for that JAX, and jshard.
MAXTEXT_PYTHON ?= python3.12
MAXTEXT_VENV   ?= .venv-maxtext
MAXTEXT_STAMP  := $(MAXTEXT_VENV)/.installed

$(MAXTEXT_STAMP): pyproject.toml
	$(MAXTEXT_PYTHON) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet maxtext==0.2.5
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet -r $$($(MAXTEXT_VENV)/bin/python -c 'import maxtext, pathlib; \
	    print(pathlib.Path(maxtext.__file__).parent.parent / "dependencies/requirements/generated_requirements/decoupled-requirements.txt")')
	v=$$($(MAXTEXT_VENV)/bin/python -c 'import jax; print(jax.__version__)') && \
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet "jax-cuda13-plugin==$$v" "jax-cuda13-pjrt==$$v" nvidia-cudnn-cu13
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet -e .
	touch $(MAXTEXT_STAMP)

MAXTEXT_JSON ?= out/maxtext-side-by-side.json

maxtext-compare: $(MAXTEXT_STAMP)
	mkdir -p $(dir $(MAXTEXT_JSON))
	$(MAXTEXT_VENV)/bin/python benchmarks/maxtext_side_by_side.py --json $(MAXTEXT_JSON)
