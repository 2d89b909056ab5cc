"""Context-overflow benchmarks (issue 20): answer perplexity and TTFT of shifted reuse (CA) vs
token truncation (TT), `python -m bench.overflow.quality` and `python -m bench.overflow.ttft`."""
