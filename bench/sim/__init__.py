"""The trace simulators (`python -m bench.sim.simulate`, `python -m bench.sim.cluster`): the real
hiradix bookkeeping driven by a Mooncake-format trace, with offline references and sweeps."""
