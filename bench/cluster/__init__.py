"""The cluster benchmark (`python -m bench.cluster`): servers behind a router, with and without a
shared store. `run` drives it, `report` reads the records."""
