# The two commands a newcomer runs (see README):
#   make quickstart   set up .venv, then an RL run of the embedded default recipe
#   make test         set up .venv, then the CPU test suite (what CI runs)
.PHONY: setup quickstart test test-all
setup:
	bash scripts/setup.sh
quickstart: setup
	.venv/bin/rlfp8-train recipe=quickstart
test: setup
	.venv/bin/python -m pytest -m "not gpu" -q
