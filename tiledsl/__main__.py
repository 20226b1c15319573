"""`python -m tiledsl`: the `tiledsl` command."""
import sys

from .cli.main import main

sys.exit(main())
