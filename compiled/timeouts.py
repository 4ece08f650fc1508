"""How long a bridge waits for its peers, and what a failed wait says.

Every collective a bridge issues runs on a process group created with the timeout
:func:`timeout_seconds` (environment variable ``MIMO_FX_TIMEOUT``, seconds; 300 by
default, well under gloo's and NCCL's 30 minutes), read when the group is created. A
rank whose peer never comes -- it skipped a call or its backward, or left -- gets an
error after that long instead of waiting forever.

>>> import os; os.environ.pop("MIMO_FX_TIMEOUT", None) is None or True
True
>>> timeout_seconds()
300.0
"""

from __future__ import annotations

import os

from mimo_fx.errors import MimoFxError

__all__ = ["timeout_seconds", "wait_time", "cause", "ENV", "DEFAULT"]

ENV = "MIMO_FX_TIMEOUT"
LEGACY = "MIMO_FX_CHECK_TIMEOUT"  # the name of the check groups' timeout before it
DEFAULT = 300.0


def timeout_seconds() -> float:
    """Seconds a bridge's collective waits for its peers (``MIMO_FX_TIMEOUT``)."""
    name = ENV if ENV in os.environ else LEGACY if LEGACY in os.environ else None
    text = os.environ.get(name, str(DEFAULT)) if name else str(DEFAULT)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise MimoFxError(f"{name}={text!r} must be a positive number of seconds")
    return seconds


def wait_time() -> str:
    """The timeout, as a message states it."""
    return f"{ENV}={timeout_seconds():g} s"


def cause(err: BaseException) -> str:
    """A runtime error in one line, for a message that explains it (gloo and NCCL
    errors run to many lines)."""
    return f"{err.__class__.__name__}: {str(err).splitlines()[0][:200]}"
