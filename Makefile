# The two commands of the README. Each installs what it needs first (idempotent), into the
# active virtual environment or the project's .venv (scripts/python.sh says which).
.PHONY: demo test install lint

PY = $(shell bash scripts/python.sh)

install:
	PYTHON=$(PY) bash scripts/install.sh

demo: install
	$(PY) -m twinkled.demo

test: install
	$(PY) -m pytest -q tests

lint:
	$(PY) -m ruff check .
