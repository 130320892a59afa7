"""The GPU lane's tests use the CPU lane's engine helpers (``tests/e2e``) and real cache-server
processes (``tests/server``): both directories are importable from every test here."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for _d in ("server", "e2e"):
    if str(_TESTS / _d) not in sys.path:
        sys.path.insert(0, str(_TESTS / _d))
