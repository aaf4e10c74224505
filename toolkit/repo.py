"""Where the toolkit's own files are: the repository root (recipes/, ds_configs/, tokenizers named relative to it).
At the bottom of the layers, so that a command which only copies checkpoint files (toolkit/checkpoint/copy_only.py)
finds it without loading the recipe schema."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
