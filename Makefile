PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test clean chromium

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,track,report,lora]'
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
