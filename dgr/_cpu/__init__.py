"""Private: the CPU code dgr's compiled core was built for, and whether this CPU runs it
(``dgr._cpu._cpu``, compiled without llama.cpp and without ``-march``). ``dgr._core`` and
``dgr._chat`` call :func:`require` before they load."""

from dgr._cpu._cpu import REQUIRES, VARIANT, has, missing, require

__all__ = ["VARIANT", "REQUIRES", "has", "missing", "require"]
