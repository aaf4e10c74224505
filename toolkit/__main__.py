"""`python -m toolkit` is the `toolkit` command."""
from toolkit.cli import entry

entry()
