"""Every library module is touched by the run (the fast subset's promise too: ``python
-m pytest -m "not slow"`` imports every module under mimo_fx/, compiled/ and reference/
in a test module, a test or a world's process). With ``MIMO_FX_TRACK_CALLS=1`` it also
checks that a function of every module ran (slower: see mimo_fx.testing.touched).

It runs last (tests/conftest.py orders it) and only counts for a whole run: the
testpaths, with no ``-k``, ``--lf`` or explicit paths.
"""

from __future__ import annotations

import pytest

from mimo_fx.testing import touched


def _whole_run(config) -> bool:
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and not config.option.keyword and not getattr(config.option, "lf", False)
            and not getattr(config.option, "stepwise", False))


def test_every_library_module_is_touched_by_the_run(request, touched_modules):
    if not _whole_run(request.config):
        pytest.skip("counts only for a whole run (python -m pytest [-m 'not slow'])")
    library = touched.library()  # module -> whether it defines a function
    kind = "called" if touched.tracking() else "imported"
    # a module without functions is all run once imported
    bare = {m for m in touched_modules["imported"] if not library[m]}
    missing = sorted(set(library) - touched_modules[kind] - bare)
    assert not missing, f"no test of this run {kind} {missing}"
