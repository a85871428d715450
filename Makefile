# `make demo` and `make test` set everything up on a fresh machine (a local .venv) and run.
# demo needs only the planner (no torch, no engines); test installs the rest.
PYTHON ?= python3
# e.g. https://download.pytorch.org/whl/cpu, where the registry's torch wheel is the CUDA build
TORCH_INDEX ?=
VENV ?= .venv
BIN := $(VENV)/bin
PLANNER_STAMP := $(VENV)/.hetplan-planner
FULL_STAMP := $(VENV)/.hetplan-full
# setuptools' notice on every editable install (folders named like the package take precedence: here they are the
# package) is 10 lines of noise before the demo's output
EDITABLE_QUIET := PYTHONWARNINGS="ignore:Editable installation:UserWarning"

.PHONY: demo test lint bench clean

$(PLANNER_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(EDITABLE_QUIET) $(BIN)/python -m pip install --quiet -e .
	touch $(PLANNER_STAMP)

$(FULL_STAMP): $(PLANNER_STAMP)
	# the CPU build of torch first: a bare `torch` requirement would pull the multi-GB CUDA build
	$(BIN)/python -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	DS_BUILD_OPS=0 $(EDITABLE_QUIET) $(BIN)/python -m pip install --quiet -e '.[torch,dev,engines]'
	touch $(FULL_STAMP)

demo: $(PLANNER_STAMP)
	$(BIN)/hetplan plan --cluster examples/hethub-768.yaml --model llama-140b --top-k 3 --out hethub-768.plan.json

test: $(FULL_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest

lint: $(FULL_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(FULL_STAMP)
	$(BIN)/python bench/plan_examples.py
	$(BIN)/python bench/search_scaling.py
	$(BIN)/python bench/profile_repeatability.py
	$(BIN)/python bench/measured_vs_simulated.py
	$(BIN)/python bench/predictor_accuracy.py
	$(BIN)/python bench/replan.py
	$(BIN)/python bench/runtime_vs_prediction.py
	$(BIN)/python bench/elastic.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
