"""`python -m toolkit` is the `toolkit` command."""
from toolkit.cli import main

raise SystemExit(main())
