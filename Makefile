PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

TORCH_VERSION := 2.13.0
EXTRAS := --extra test --extra track --extra report --extra lora
# torch and the CUDA runtime its PyPI build pulls: `pip install torch==$(TORCH_VERSION)` installs them (a CPU build
# where one lies in pip's find-links), so the lock leaves them out.
TORCH_PACKAGES := torch triton cuda-bindings cuda-pathfinder cuda-toolkit nvidia-cublas nvidia-cuda-cupti \
	nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver \
	nvidia-cusparse nvidia-cusparselt-cu13 nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx

.PHONY: install demo test clean chromium lock

# Every file pip installs is checked against its sha256 (--require-hashes): pip from requirements-pip.txt, every
# package but torch from requirements.lock, torch and its CUDA runtime from requirements-torch.txt. A torch build in
# pip's find-links (a CPU build) is taken first (--no-index); pip would otherwise prefer the index's hashed links.
$(STAMP): pyproject.toml requirements.lock requirements-pip.txt requirements-torch.txt Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "Python 3.11 or newer is needed (requirements.lock is resolved for 3.11+): make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --require-hashes -r requirements-pip.txt
	$(BIN)/pip install --quiet --require-hashes --no-deps -r requirements.lock
	$(BIN)/pip install --quiet --require-hashes --no-index -c requirements-torch.txt torch==$(TORCH_VERSION) 2>/dev/null || \
	  $(BIN)/pip install --quiet --require-hashes -c requirements-torch.txt torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/pip check
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/trainlift train examples/tiny-local.yaml
	$(BIN)/trainlift eval runs/tiny-demo/final --data examples/data/tasks-eval.jsonl --show 8

# The report's browser check needs Chromium: installed here where apt works (as root or with sudo), else skipped.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] && SUDO= || SUDO=sudo; \
	    $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; } ; } || \
	  echo "Chromium not installed: the report's browser test will be skipped"

test: $(STAMP) chromium
	$(BIN)/python -m pytest -q --durations=40

clean:
	rm -rf $(VENV) runs .pytest_cache

# Re-resolve requirements.lock for Python 3.11+ on every platform, keeping the locked releases that pyproject.toml
# still allows (UPGRADE=--upgrade moves everything to the newest it allows); then run `make test`. It needs only uv,
# so a dependency added to pyproject.toml can be locked before the venv can install it.
lock:
	@test -x $(BIN)/uv || { $(PYTHON) -m venv $(VENV) && $(BIN)/pip install --quiet uv; }
	echo "torch==$(TORCH_VERSION)" > $(VENV)/torch-pin.txt
	$(BIN)/uv pip compile pyproject.toml $(EXTRAS) --constraint $(VENV)/torch-pin.txt --universal --generate-hashes \
	  --no-header --no-annotate $(UPGRADE) $(addprefix --no-emit-package ,$(TORCH_PACKAGES)) -o requirements.lock

# Mutation testing of the core math (bench/mutation.py; docs/layout.md): a tool, not part of `make test`. mutmut,
# pinned with hashes in mutation/requirements.txt, goes into .venv/mutmut, not the project's site-packages.
# MUTATION_ARGS="--target lr_schedule --max-children 2" picks targets of mutation/targets.toml (default: all).
MUTMUT_DIR := $(VENV)/mutmut
MUTMUT_STAMP := $(MUTMUT_DIR)/.installed

$(MUTMUT_STAMP): mutation/requirements.txt $(STAMP)
	rm -rf $(MUTMUT_DIR)
	$(BIN)/pip install --quiet --require-hashes --no-deps --target $(MUTMUT_DIR) -r mutation/requirements.txt
	touch $(MUTMUT_STAMP)

.PHONY: mutation
mutation: $(STAMP) $(MUTMUT_STAMP)
	nice -n 10 $(BIN)/python bench/mutation.py $(MUTATION_ARGS)
