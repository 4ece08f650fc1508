"""pytest collects docs/ for doctests (pyproject.toml): the llava example imports
transformers, an optional extra (``pip install -e ".[hf]"``), so without it the example
is not collected (tests/mimo_layer/test_llava.py skips its run and says why). The Megatron example
imports Megatron's ``HyperCommGrid`` (megatron-core is never installed:
tests/interop/test_megatron_interop.py loads it from the release's wheel and runs the example)."""

import importlib.util

collect_ignore = ["examples/megatron_switch.py"] + (
    [] if importlib.util.find_spec("transformers") is not None else ["examples/llava_step.py"])
