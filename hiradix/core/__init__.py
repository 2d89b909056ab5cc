"""The pure core of hiradix: bookkeeping and decisions, no torch, zmq, sglang, files or processes.

Read in this order: :mod:`~hiradix.core.node` (records), :mod:`~hiradix.core.tree` (match,
insert, split, locks, candidates), :mod:`~hiradix.core.policy` (ranking + registry),
:mod:`~hiradix.core.lookahead` (the queue window), :mod:`~hiradix.core.allocator` (page ids),
:mod:`~hiradix.core.ledger` (two-phase transfers, the books), :mod:`~hiradix.core.placement`
(which copy leaves which tier), :mod:`~hiradix.core.controller` (when to move what),
:mod:`~hiradix.core.ports` (what it asks of data movement), :mod:`~hiradix.core.prefix_cache`
(the prefix-cache logic the server and the simulator share). ``tests/test_layering.py`` keeps
this package free of I/O imports.
"""
