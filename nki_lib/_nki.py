"""The one place through which every kernel of nki-lib imports NKI.

Kernels write ``from nki_lib._nki import nki, nl, nisa`` and nothing else NKI-related, so the same
kernel source runs on the real ``nki`` package (Trainium, or AWS's own ``nki.simulate``) and on
``nki_lib.simulator``.

Selection, made once at import:

* ``NKI_LIB_NKI=real``: the real package; an ImportError if it is missing or unusable.
* ``NKI_LIB_NKI=simulator``: always ``nki_lib.simulator``.
* unset / ``auto``: the real package when it imports and looks like the real thing (PyPI's ``nki``
  is an empty placeholder and does not count), else ``nki_lib.simulator``.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["nki", "nl", "nisa", "USING_REAL_NKI", "real_nki_usable"]


def real_nki_usable() -> bool:
    """True when a real, working ``nki`` package (with jit, language and isa) is importable."""
    try:
        real = importlib.import_module("nki")
        importlib.import_module("nki.language")
        importlib.import_module("nki.isa")
    except Exception:
        return False
    # The simulator may have been installed under the name ``nki``: that is not the real package.
    if getattr(real, "__nki_lib_simulator__", False):
        return False
    return all(hasattr(real, name) for name in ("jit", "simulate", "language", "isa"))


def _select():
    choice = os.environ.get("NKI_LIB_NKI", "auto").strip().lower()
    if choice not in ("auto", "real", "simulator"):
        raise ValueError(f"NKI_LIB_NKI must be 'auto', 'real' or 'simulator', got {choice!r}")
    if choice == "real" or (choice == "auto" and real_nki_usable()):
        if not real_nki_usable():
            raise ImportError("NKI_LIB_NKI=real but no working `nki` package is installed")
        nki_mod = importlib.import_module("nki")
        return nki_mod, importlib.import_module("nki.language"), importlib.import_module("nki.isa"), True
    from nki_lib import simulator

    return simulator, simulator.language, simulator.isa, False


nki, nl, nisa, USING_REAL_NKI = _select()
