"""Bytes inside the scheduler process: the paged KV layout, HBM <-> DRAM movers, layer-wise loads.

Only page ids and op ids come in (from the core's ledger); no bookkeeping happens here.
"""
