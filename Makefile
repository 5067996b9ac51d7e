# The two commands of the README. Each installs what it needs first (idempotent).
.PHONY: demo test install lint

install:
	bash scripts/install.sh

demo: install
	python3 -m twinkled.demo

test: install
	python3 -m pytest -q tests

lint:
	ruff check .
