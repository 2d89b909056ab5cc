"""Storage media: the DRAM page pool (shared memory), the NVMe slot file, checksums, file helpers,
and (``store/``) the cluster store shared by the servers.

Data movement only: which page ids are free is the core's business
(:class:`hiradix.core.allocator.PageAllocator`); only page and slot ids come in.
"""
