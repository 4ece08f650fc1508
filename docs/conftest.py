"""pytest collects docs/ for doctests (pyproject.toml): the llava example imports
transformers, an optional extra (``pip install -e ".[hf]"``), so without it the example
is not collected (tests/test_llava.py skips its run and says why)."""

import importlib.util

collect_ignore = ([] if importlib.util.find_spec("transformers") is not None
                  else ["examples/llava_step.py"])
