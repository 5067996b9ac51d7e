# The README's commands. Each installs what it needs first (idempotent), into the active
# virtual environment or the project's .venv (scripts/python.sh says which), and says what
# it is doing.
.PHONY: demo test test-fast install serve lint

PY = $(shell bash scripts/python.sh)

# Then the tinker SDK versions tests/test_tinker_versions.py runs, each in its own directory
# of a cache outside the checkout ($TWINKLE_TINKER_SDKS, ~/.cache/twinkle/tinker-sdks);
# offline it says so and the test skips them.
install:
	@echo "make: installing into $(PY) (scripts/install.sh)"
	PYTHON=$(PY) bash scripts/install.sh
	@echo "make: the tinker SDKs the version test runs (tests/tinker_sdks.py install)"
	$(PY) tests/tinker_sdks.py install

demo: install
	@echo "make: running the demo (python -m twinkled.server.demo)"
	$(PY) -m twinkled.server.demo

# The demo's tiny model on a persistent data dir, in the foreground (twinkled/server/demo_next.py:
# TWINKLE_PORT, TWINKLE_DEMO_DATA).
serve: install
	@echo "make: serving the demo's tiny model (python -m twinkled.server.demo_next)"
	$(PY) -m twinkled.server.demo_next

# The suite in 4 processes (pytest-xdist; a file's tests stay together, so the daemons a
# module shares start once): much of a test's time is waiting on daemons and workers, so 4
# processes keep 2 cores busy (on 2 idle cores, 3 and 4 processes took within 3% of each
# other; the suite is CPU-bound). The longest files start first, in the order
# tests/conftest.py gives (LONGEST_FIRST; xdist's own would start them last). TEST_WORKERS=0
# runs it in one process; TESTS=tests/test_x.py runs one file.
# Bytecode caches are on for the suite, whatever PYTHONDONTWRITEBYTECODE says (some sandboxes
# and CI images set it): the project's is written first (under a second in a fresh checkout,
# nothing after), as the suite starts some 250 Python processes that import it (daemons,
# their workers, ctl), each of which compiled it again (measured: ~0.4 s of CPU at every
# worker start); and pytest keeps its assert-rewritten test modules, which each of its
# processes otherwise rewrote at collection (12 -> 7 s of CPU a process, the suite's first
# ~25 s). __pycache__ is git-ignored.
TEST_WORKERS ?= 4
TESTS ?= tests
PACKAGES = twinkled scheduler tinker_shim openai_shim anthropic_shim twinkle_sdk
test: install
	@echo "make: running the test suite (pytest $(TESTS), $(TEST_WORKERS) processes)"
	-$(PY) -m compileall -q $(PACKAGES)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(TESTS)

# The edit loop's tier: the tests that start no daemon (engine, scheduler, store, codecs,
# layers), in about a minute.
FAST_TESTS = tests/test_scheduler.py tests/test_scheduler_time.py tests/test_layers.py \
	tests/test_store.py tests/test_journal.py tests/test_lost_gradients.py tests/test_step_runner.py \
	tests/test_tinker_codec.py tests/test_stability.py tests/test_sdk_data.py \
	tests/test_layout.py tests/test_engine_bad_input.py tests/test_engine_lora.py \
	tests/test_engine_losses.py tests/test_engine_optim.py tests/test_engine_sampling.py \
	tests/test_engine_state.py tests/test_engine_model.py tests/test_engine_packed.py \
	tests/test_prefix_cache.py tests/test_engine_kernels.py \
	tests/test_shared_prefix.py tests/test_lora_kernels.py \
	tests/test_chunked_logprobs.py tests/test_fused_lora.py tests/test_tinker_json_wire.py \
	tests/test_sdk_tracking.py
test-fast: install
	@echo "make: running the fast tests (no daemon)"
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(FAST_TESTS)

lint:
	$(PY) -m ruff check .
