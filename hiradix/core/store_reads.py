"""Load or recompute at run time: moving estimates of the store's read bandwidth and the prefill
rate, and the per-request choice of how much of a store hit to read (issue 19, item 4).

A page in the cluster store is worth reading only if reading it is faster than prefilling its
tokens again. Both rates change at run time (the link is shared, the batch mix changes), so each
server measures them (:class:`DecayedRate`, :class:`PrefillRate`, pure bookkeeping: the caller
passes amounts and seconds it measured) and :class:`StoreReadChoice` turns them into a number of
pages with :func:`hiradix.core.load_or_recompute.tokens_worth_loading`. The read is not overlapped
with the prefill (``overlap=False``): a GET lands in DRAM before the request is admitted, and only
the DRAM -> HBM promotion is layer-wise, so the store run is read whole or not at all.

* Store reads: every GET that moved pages gives ``(bytes, seconds)`` (the I/O worker's wall time
  of the job: per-object latency included, queueing not).
* Prefill: every extend batch gives ``(tokens, seconds)``. The rate used is the marginal one, the
  slope of a least-squares line ``seconds = a + tokens / rate`` with exponential forgetting (a
  cached turn's short batch costs a fixed part that recomputing its history would not add
  again); while the batch sizes seen are too alike to fit a slope, the throughput
  (tokens / seconds) is used.
* A run is skipped only when its read is estimated ``SKIP_MARGIN`` times slower than its
  prefill: a read also spares the prefill's compute for the other requests (which this request's
  TTFT does not show), and short GETs carry a per-request latency the linear model leaves out.
* Before both have ``MIN_SAMPLES`` samples the choice reads everything (as without this module).
* A skip stops the bandwidth samples, so one lookup in ``PROBE_EVERY_SKIPS`` that would be
  skipped is read anyway (a probe: a faster link is noticed again).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from hiradix.core.load_or_recompute import tokens_worth_loading

logger = logging.getLogger(__name__)

READ_MODES: tuple[str, ...] = ("auto", "always", "never")  # --hiradix-store-read
MIN_SAMPLES = 3  # samples each estimate needs before a read may be skipped
PROBE_EVERY_SKIPS = 32  # a skipped lookup in this many is read anyway (keeps the bandwidth measured)
RATE_DECAY = 0.7  # weight left to the past per new store-read sample
FIT_DECAY = 0.95  # weight left to the past per new prefill sample (~20 batches of memory)
SKIP_MARGIN = 1.5  # a read is skipped only when estimated this many times slower than recomputing
LOW_FOUND_SHARE = 0.1  # a lookup is skipped only for tails whose pages lookups (nearly) never find
MIN_SPREAD = 0.25  # batch sizes' coefficient of variation needed to fit the prefill slope


class DecayedRate:
    """A moving rate: decayed sum of amounts / decayed sum of seconds (a sample weighs by its
    duration, so one slow read pulls the estimate down at once).

    Args:
        decay: weight left to the past per sample, in (0, 1).
    """

    def __init__(self, decay: float = RATE_DECAY):
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.samples = 0
        self._amount = 0.0
        self._seconds = 0.0

    def add(self, amount: float, seconds: float) -> None:
        """One sample: ``amount`` (bytes, tokens) moved in ``seconds``; ignored unless both > 0."""
        if amount <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        self._amount = self._amount * self.decay + amount
        self._seconds = self._seconds * self.decay + seconds
        self.samples += 1

    @property
    def per_s(self) -> Optional[float]:
        """The rate, in amount per second; None before the first sample."""
        return self._amount / self._seconds if self.samples else None


class PrefillRate:
    """Marginal prefill rate from ``(tokens, seconds)`` of extend batches: the slope of
    ``seconds = a + tokens / rate`` by least squares with exponential forgetting; the throughput
    (:class:`DecayedRate`) while the batch sizes are too alike to fit it (or the fit is not
    increasing).

    Args:
        decay: weight left to the past per sample, in (0, 1).
    """

    def __init__(self, decay: float = FIT_DECAY):
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.samples = 0
        self._s = [0.0] * 5  # decayed sums of 1, x, y, x*x, x*y (x tokens, y seconds)
        self.throughput = DecayedRate(decay)

    def add(self, tokens: float, seconds: float) -> None:
        """One extend batch: ``tokens`` prefilled in ``seconds``; ignored unless both > 0."""
        if tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        d = self.decay
        self._s = [v * d + add for v, add in zip(self._s, (1.0, tokens, seconds, tokens * tokens, tokens * seconds))]
        self.throughput.add(tokens, seconds)
        self.samples += 1

    @property
    def slope_s_per_token(self) -> Optional[float]:
        """Fitted seconds per extra token, or None (too few samples, sizes too alike, slope <= 0)."""
        w, x, y, xx, xy = self._s
        if self.samples < 2:
            return None
        var_x = xx / w - (x / w) ** 2
        if var_x < (MIN_SPREAD * x / w) ** 2:
            return None
        slope = (xy / w - (x / w) * (y / w)) / var_x
        return slope if slope > 0 else None

    @property
    def per_s(self) -> Optional[float]:
        """Prefill tokens per second (marginal if fitted, else throughput); None before a sample."""
        slope = self.slope_s_per_token
        return 1.0 / slope if slope is not None else self.throughput.per_s


class FoundShare:
    """The decayed share of a tail's pages that store lookups found, per tail length (powers of
    two of tokens): a new user turn is never found, a history moved from another server is.
    ``of`` is 1.0 for a length with fewer than ``min_samples`` lookups (ask until it is known)."""

    def __init__(self, decay: float = RATE_DECAY, min_samples: int = MIN_SAMPLES):
        self.decay, self.min_samples = decay, min_samples
        self._by_bucket: dict[int, list[float]] = {}  # bucket -> [decayed found share sum, decayed count, samples]

    def add(self, tail_tokens: int, share: float) -> None:
        entry = self._by_bucket.setdefault(max(0, int(tail_tokens)).bit_length(), [0.0, 0.0, 0])
        entry[0] = entry[0] * self.decay + share
        entry[1] = entry[1] * self.decay + 1.0
        entry[2] += 1

    def of(self, tail_tokens: int) -> float:
        entry = self._by_bucket.get(max(0, int(tail_tokens)).bit_length())
        return 1.0 if entry is None or entry[2] < self.min_samples else entry[0] / entry[1]


class StoreReadChoice:
    """How many pages of a store hit one server reads (``--hiradix-store-read``), from its own
    measurements; counts what it skipped.

    Args:
        mode: ``auto`` (read while faster than recomputing), ``always`` or ``never``.
        bytes_per_token: KV bytes of one token on this rank (all layers, K and V).
        page_size: tokens per page.
        min_samples: samples each estimate needs before ``auto`` may skip.
        probe_every: one in this many skip decisions reads anyway (``auto``).
        skip_lookups: also skip lookups unlikely to pay (:meth:`lookup_worth`; ``auto`` at TP 1).

    Raises:
        ValueError: unknown mode, or non-positive sizes.
    """

    def __init__(self, mode: str, bytes_per_token: float, page_size: int, min_samples: int = MIN_SAMPLES,
                 probe_every: int = PROBE_EVERY_SKIPS, skip_lookups: bool = False):
        if mode not in READ_MODES:
            raise ValueError(f"store read mode must be one of {list(READ_MODES)}, got {mode!r}")
        if bytes_per_token <= 0 or page_size < 1 or probe_every < 1:
            raise ValueError(f"need bytes_per_token > 0, page_size >= 1, probe_every >= 1; "
                             f"got {bytes_per_token}, {page_size}, {probe_every}")
        self.mode = mode
        self.bytes_per_token = bytes_per_token
        self.page_size = page_size
        self.min_samples = min_samples
        self.probe_every = probe_every
        self.read = DecayedRate()  # store -> DRAM, bytes/s
        self.prefill = PrefillRate()  # tokens/s
        self.lookup = DecayedRate()  # lookups answered per second of their round trip (1 / mean round trip)
        self.found_share = FoundShare()  # share of a tail's pages lookups found, by tail length
        self.skip_lookups = skip_lookups
        self.skipped_lookups = 0  # lookups not asked: the tail recomputes faster than the round trip
        self._lookups_since_probe = 0
        self.skipped_pages = 0  # pages found in the store and recomputed instead (auto, never)
        self.probes = 0  # reads made although they looked slower (auto)
        self._skips_since_probe = 0
        self._logged = False

    @property
    def reads_store(self) -> bool:
        """False with ``never``: no lookups, no GETs (the store is still written)."""
        return self.mode != "never"

    def note_get(self, num_bytes: float, seconds: float) -> None:
        """A GET moved ``num_bytes`` into DRAM in ``seconds`` (the I/O worker's job time)."""
        self.read.add(num_bytes, seconds)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """An extend batch prefilled ``tokens`` in ``seconds``."""
        self.prefill.add(tokens, seconds)

    def note_lookup(self, seconds: float, tail_tokens: int, asked_pages: int, found_pages: int) -> None:
        """A lookup of a ``tail_tokens`` tail took ``seconds`` from its start to its agreed answer
        (what an admission waits) and found ``found_pages`` of the ``asked_pages`` it asked."""
        self.lookup.add(1.0, seconds)
        if asked_pages > 0:
            self.found_share.add(tail_tokens, found_pages / asked_pages)

    def lookup_worth(self, tail_tokens: int) -> bool:
        """Whether to ask the store for a tail of ``tail_tokens`` after a local match (a request
        waits for that answer at admission). Not asked: tails of a length whose pages lookups
        (nearly) never find (below ``LOW_FOUND_SHARE``: under cache-aware routing the tail is the
        new user turn, which no server has computed) and whose prefill that share could save is
        below the measured lookup round trip. A history that moved to this server is found, and
        asked for, whatever the rates say: a returning turn pays only for its new tokens. Always
        asked before the estimates are measured, and without ``skip_lookups`` (TP: every rank must
        ask the same lookups); one skip in ``probe_every`` asks anyway, keeping the estimates
        measured. Counts the lookups skipped."""
        if not self.reads_store:
            return False
        measured = self.lookup.samples >= self.min_samples and self.prefill.samples >= self.min_samples
        share = self.found_share.of(tail_tokens)
        if (not self.skip_lookups or not measured or share >= LOW_FOUND_SHARE
                or share * tail_tokens / self.prefill.per_s >= 1.0 / self.lookup.per_s):
            return True
        self._lookups_since_probe += 1
        if self._lookups_since_probe >= self.probe_every:
            self._lookups_since_probe = 0
            return True
        self.skipped_lookups += 1
        return False

    @property
    def measured(self) -> bool:
        """Both estimates have enough samples for ``auto`` to skip reads."""
        return self.read.samples >= self.min_samples and self.prefill.samples >= self.min_samples

    def worth_pages(self, pages: int) -> int:
        """Leading pages of a store run of ``pages`` worth reading now (pure: counts nothing)."""
        if self.mode == "never":
            return 0
        if self.mode == "always" or pages <= 0 or not self.measured:
            return max(0, pages)
        tokens = tokens_worth_loading([("store", pages * self.page_size)], {"store": self.read.per_s},
                                      self.bytes_per_token, self.prefill.per_s / SKIP_MARGIN, overlap=False,
                                      page_size=self.page_size)
        return tokens // self.page_size

    def pages_to_read(self, pages: int) -> int:
        """Decide one lookup's read: :meth:`worth_pages`, with a probe now and then; counts the
        skipped pages and logs the first skip (info) with the estimates."""
        worth = self.worth_pages(pages)
        if worth >= pages or self.mode != "auto":
            self._count_skip(pages - worth)
            return worth
        self._skips_since_probe += 1
        if self._skips_since_probe >= self.probe_every:
            self._skips_since_probe = 0
            self.probes += 1
            return pages
        self._count_skip(pages - worth)
        return worth

    def _count_skip(self, pages: int) -> None:
        if pages <= 0:
            return
        self.skipped_pages += pages
        if not self._logged and self.mode == "auto":
            self._logged = True
            logger.info("hiradix: store pages recomputed instead of read (first time: %d pages): %s", pages, self.summary())

    def summary(self) -> str:
        """One line with the estimates and the break-even link, for logs."""
        read, prefill = self.read.per_s, self.prefill.per_s
        even = f"{self.bytes_per_token * prefill / SKIP_MARGIN / 1e6:.1f} MB/s" if prefill else "?"
        return (f"store read {read / 1e6 if read else 0:.1f} MB/s ({self.read.samples} GETs), prefill "
                f"{prefill or 0:.0f} tokens/s ({self.prefill.samples} batches), {self.bytes_per_token:.0f} "
                f"KV bytes/token: reading pays above {even}")
