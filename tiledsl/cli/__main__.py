"""`python -m tiledsl.cli`: the `tiledsl` command."""
import sys

from .main import main

sys.exit(main())
