"""TTFT by tier (`python -m bench.ttft.by_tier`) and a py-spy profile of cached turns
(`python -m bench.ttft.profile`)."""
