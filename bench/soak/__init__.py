"""The soak (`python -m bench.soak`, `scripts/soak`): churned load against a real server, then leak checks."""
