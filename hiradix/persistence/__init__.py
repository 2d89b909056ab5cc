"""Restart persistence of the NVMe tier: the durable slot index, its glue to the tree, the fingerprint."""
