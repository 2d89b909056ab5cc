"""Quality of compressed cold tiers (``--hiradix-cold-format``) on the trained model (issue 21, item 3)."""
