# Two commands a new machine needs: `make demo` (the main job) and `make test`.
# Both provision first: a virtual environment with the pinned test dependencies and a real
# ComfyUI host (scripts/provision.sh; a second run takes seconds).
PY := .venv/bin/python

.PHONY: setup demo demo-pictures test bench-smoke workflows tiny-models tinyworld-results

setup:
	bash scripts/provision.sh

# the pictures first (docs/demo/, deterministic: a fresh clone regenerates them byte for byte),
# then the table of every backbone through a real headless ComfyUI
demo: setup
	$(PY) scripts/demo_pictures.py
	$(PY) scripts/demo.py

demo-pictures: setup
	$(PY) scripts/demo_pictures.py

# two workers, one per core of the CI machine; every test keeps to its own temporary folders and ports
test: setup
	$(PY) -m pytest -q -n 2 tests

workflows:
	python3 scripts/make_workflows.py

tiny-models: setup
	$(PY) scripts/make_tiny_models.py

# The README's tiny-world results: the bundled model at the default settings (~1 hour, not CI).
tinyworld-results: setup
	bash scripts/tinyworld_results.sh
