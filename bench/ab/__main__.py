"""`python -m bench.ab`: see `bench.ab.run`."""

import sys

from bench.ab.run import main

sys.exit(main())
