# Set-up and entry points. Every target creates or reuses the project virtual environment (.venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

WORLD := .cache/demo-world

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0  # first: a local CPU wheel; see README
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m evoesap pipeline demo --out runs/demo

bench: $(STAMP)
	$(PY) -m evoesap demo build --out $(WORLD)
	$(PY) benchmarks/bench_calibrate.py
	$(PY) benchmarks/bench_search.py --model $(WORLD)/model \
		--data $(WORLD)/data/code/search.jsonl $(WORLD)/data/copy/search.jsonl $(WORLD)/data/facts/search.jsonl $(WORLD)/data/math/search.jsonl \
		--calibration $(WORLD)/data/code/calibration.jsonl $(WORLD)/data/copy/calibration.jsonl $(WORLD)/data/facts/calibration.jsonl $(WORLD)/data/math/calibration.jsonl \
		--sweep --racing-min-positions 64  # the demo's 64 mixed search samples hold ~1,080 scored positions

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
