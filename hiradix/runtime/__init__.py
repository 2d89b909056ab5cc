"""Assembly of the real tiers in a scheduler process: media, the I/O worker, locks, TP agreement, metrics."""
