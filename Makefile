# The README's commands. Each installs what it needs first (idempotent), into the active
# virtual environment or the project's .venv (scripts/python.sh says which), and says what
# it is doing.
.PHONY: demo test install serve lint

PY = $(shell bash scripts/python.sh)

install:
	@echo "make: installing into $(PY) (scripts/install.sh)"
	PYTHON=$(PY) bash scripts/install.sh

demo: install
	@echo "make: running the demo (python -m twinkled.server.demo)"
	$(PY) -m twinkled.server.demo

# The demo's tiny model on a persistent data dir, in the foreground (twinkled/server/demo_next.py:
# TWINKLE_PORT, TWINKLE_DEMO_DATA).
serve: install
	@echo "make: serving the demo's tiny model (python -m twinkled.server.demo_next)"
	$(PY) -m twinkled.server.demo_next

test: install
	@echo "make: running the test suite (pytest tests)"
	$(PY) -m pytest -q tests

lint:
	$(PY) -m ruff check .
