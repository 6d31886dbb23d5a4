# The commands of the README: `make demo`, `make check` (the fast lane) and `make test`.
# Each creates .venv and installs everything it needs from the package registries.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: demo check test lint bench clean system-deps browser lab bytecode

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Java 17+ for Spark: Debian's headless JRE when `java` is missing. PostgreSQL for the
# Dagster instance of a cluster (deploy/postgres.py): Debian's postgresql when no initdb
# is on PATH or under /usr/lib/postgresql.
system-deps:
	@command -v java >/dev/null 2>&1 || { \
	  echo "java not found: installing Debian's openjdk-17-jre-headless"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless; }
	@{ command -v initdb || ls /usr/lib/postgresql/*/bin/initdb; } >/dev/null 2>&1 || { \
	  echo "PostgreSQL not found: installing Debian's postgresql (the Dagster instance of a cluster)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; }

# Chromium for the test that opens the Dagster UI's lineage page (tests only).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "chromium not found: installing Debian's chromium (the UI lineage test's headless browser)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(MAKE) --no-print-directory system-deps
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The project's modules compiled to bytecode (in a moment when they are current). A shell
# that sets PYTHONDONTWRITEBYTECODE (this project's CI machine does) never writes it, and
# then every process compiles src/ from source as it imports it: each `vchan` child, Dagster
# code server and run worker of a test run, 0.2-0.3 CPU s a process.
bytecode: $(STAMP)
	@$(PY) -m compileall -q src >/dev/null

demo: bytecode
	$(VENV)/bin/vchan demo $(ARGS)

# JupyterLab on the notebooks, with this .venv as the kernel (the `lab` extra, pinned).
# Point the notebooks at your `vchan up` stack or cluster with their `MODE = "live"` cell.
LAB_STAMP := $(VENV)/.lab-installed
$(LAB_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,lab]'
	touch $(LAB_STAMP)

lab: $(LAB_STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(ARGS)

# Two lanes side by side: most tests wait on etcd, JVMs and child processes, so two pytest
# processes share the 2 cores well. The side lane runs tests/defs, then the notebook and
# cluster tests in a second process: tests/defs run Dagster in-process against a Spark Connect
# server, which cannot share a process with a classic Spark session (the other tests'), and
# it leaves Spark Connect variables in its environment that a notebook kernel started from it
# would inherit. The three modules of tests/datacoord that run clusters of node processes go
# with them, so that both lanes end at about the same time (docs/testing.md has the runs).
# The side lane's reports are printed after the main lane's; `make test` fails if any of the
# three failed.
SIDE_TESTS := tests/catalog/test_notebooks.py tests/cluster tests/datacoord/test_cluster.py \
	tests/datacoord/test_node_health.py tests/datacoord/test_graceful_stop.py
test: bytecode browser
ifeq ($(strip $(ARGS)),)
	@side_log=$$(mktemp); \
	{ $(PY) -m pytest -p no:cacheprovider tests/defs; defs=$$?; \
	  $(PY) -m pytest -p no:cacheprovider $(SIDE_TESTS); exit $$((defs | $$?)); } > $$side_log 2>&1 & side=$$!; \
	$(PY) -m pytest --ignore=tests/defs $(addprefix --ignore=,$(SIDE_TESTS)); main=$$?; \
	wait $$side; side_rc=$$?; \
	echo "=== side lane: tests/defs, then $(SIDE_TESTS) (exit $$side_rc) ==="; \
	cat $$side_log; rm -f $$side_log; \
	test $$main -eq 0 && test $$side_rc -eq 0
else
	$(PY) -m pytest $(ARGS)
endif

# The fast lane, before every commit and while editing (under 2 minutes): lint, then the tests
# not marked `integration` (tests/conftest.py marks every test that needs etcd, Spark, an S3
# server, Dagster or a child process). etcd and Java are made unreachable for it, so a live test
# that the marker missed fails here instead of passing slowly.
check: lint
	VCHAN_ETCD_BINARY=/nonexistent/etcd JAVA_HOME=/nonexistent \
	  $(PY) -m pytest -p no:cacheprovider -m "not integration" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy src

bench: $(STAMP)
	$(PY) -m bench $(ARGS)

clean:
	-$(VENV)/bin/vchan down 2>/dev/null
	rm -rf .vchan
