"""Shared test configuration."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The examples and bench folders are importable as plain scripts in tests.
sys.path.insert(0, str(ROOT))
os.environ.setdefault("BROWNOUT_TESTING", "1")
