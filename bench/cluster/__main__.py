"""`python -m bench.cluster`: see `bench.cluster.run`."""

import sys

from bench.cluster.run import main

sys.exit(main())
