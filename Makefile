# Two entry points, both self-contained from a fresh clone with only python3:
#   make train  - the main job on its default: `jshard train`, a sharded GPT run on 8 fake CPU devices
#   make test   - the test suite (8 fake CPU devices)
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: train test venv clean

# Re-install only when the package definition changes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/jshard train

test: $(STAMP)
	$(VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
