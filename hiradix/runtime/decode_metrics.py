"""Prometheus series of the decode-side offload (prometheus_client; SGLang's multiprocess registry).

``sglang:hiradix_decode_offload_tokens_total{outcome}``: tokens of finished requests' pages the
decode server offloaded, by outcome (:data:`hiradix.core.decode_offload.OUTCOMES`): ``stored``
(the store acknowledged the PUT), ``staging_full`` (dropped: no DRAM staging page free),
``failed`` (the copy or the PUT failed). Same conventions as :mod:`hiradix.runtime.metrics`:
SGLang's rank labels, every label set exported at 0 from the start, counters advanced by the
delta of the cumulative counts once per scheduler step. Create it in the scheduler process only.
"""

from __future__ import annotations

from typing import Any, Mapping

from hiradix.core.decode_offload import OUTCOMES

NAME = "sglang:hiradix_decode_offload_tokens_total"
HELP = "Tokens of finished requests' pages the decode server offloaded to the cluster store, by outcome"


class DecodeOffloadMetrics:
    """Exports the decode-side offload counter of one scheduler process.

    Args:
        labels: SGLang's rank labels of this process (values are made strings).
        registry: the prometheus_client registry (default: the process's); tests pass their own.
    """

    def __init__(self, labels: Mapping[str, Any], registry: Any = None):
        from prometheus_client import REGISTRY, Counter

        self.labels = {k: str(v) for k, v in labels.items()}
        # prometheus_client appends `_total` to a counter's name itself.
        self.counter = Counter(NAME.removesuffix("_total"), HELP, [*self.labels, "outcome"],
                               registry=REGISTRY if registry is None else registry)
        for outcome in OUTCOMES:
            self.counter.labels(**self.labels, outcome=outcome)  # exported at 0 from the start
        self._seen = dict.fromkeys(OUTCOMES, 0)

    def update(self, tokens: Mapping[str, int]) -> None:
        """Advance each outcome's counter to the cumulative ``tokens[outcome]``."""
        for outcome in OUTCOMES:
            delta = tokens.get(outcome, 0) - self._seen[outcome]
            if delta > 0:
                self.counter.labels(**self.labels, outcome=outcome).inc(delta)
                self._seen[outcome] += delta
