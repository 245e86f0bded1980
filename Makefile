PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf runs/tiny-demo
	$(BIN)/trainlift train examples/tiny-local.yaml
	$(BIN)/trainlift eval runs/tiny-demo/final --data examples/data/tasks-eval.jsonl --show 8

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

clean:
	rm -rf $(VENV) runs .pytest_cache
