"""Concurrency limit algorithms: how many requests may run at once (A5).

A limit is *pure and clock-free*: it is fed one sample per finished request,
``on_sample(start_time, rtt, in_flight, dropped)``, and answers the new limit. Enforcement lives
in `brownout.Bulkhead`; the per-request bookkeeping in its `Permit`. This is the split of
Netflix's concurrency-limits (Limit vs Limiter vs Listener), so the same algorithm runs on the
event loop, in the simulator and in unit tests without any timer.

Safeguards every adaptive limit here shares:

- a *dropped* sample (rejected downstream, timed out, cancelled) never feeds the rtt estimates:
  its rtt is meaningless (often ~0 for a fast rejection); it only tells the limit to back off;
- a timeout counts as a drop (the `Bulkhead` reports `TimeoutError`/`DeadlineExceeded`/
  cancellation as dropped);
- the limit never *grows* while the work is app-limited: ``in_flight < limit / 2`` means the
  limit was not what held throughput back, so the sample says nothing about a higher limit;
- the no-load rtt is *re-probed* periodically, with jitter, by pinning the limit low for a few
  samples (Envoy's adaptive-concurrency ``minRTT`` window): without it a slowdown is mistaken
  for queueing forever, or a constant rtt lets the limit ratchet up without bound.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from itertools import islice
from typing import Protocol, runtime_checkable

__all__ = [
    "AIMDLimit",
    "FixedLimit",
    "Gradient2Limit",
    "Limit",
    "VegasLimit",
]


@runtime_checkable
class Limit(Protocol):
    """A concurrency limit algorithm."""

    @property
    def limit(self) -> int:
        """The current limit (at least 1)."""
        ...

    @property
    def adaptive(self) -> bool:
        """False when samples can never change the limit (the bulkhead then skips timing)."""
        ...

    def on_sample(self, start_time: float, rtt: float, in_flight: int, dropped: bool) -> int:
        """Learn from one finished request; return the new limit.

        ``start_time`` is when the request was admitted (monotonic seconds), ``rtt`` how long
        it ran, ``in_flight`` how many requests were running when it was admitted (itself
        included), ``dropped`` whether it was dropped, timed out or cancelled.
        """
        ...


class FixedLimit:
    """A constant limit: the safe first contract, chosen by load test (A5)."""

    __slots__ = ("_limit",)

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a limit must be at least 1")
        self._limit = int(limit)

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def adaptive(self) -> bool:
        return False

    def on_sample(self, start_time: float, rtt: float, in_flight: int, dropped: bool) -> int:
        return self._limit

    def __repr__(self) -> str:
        return f"FixedLimit({self._limit})"


def _median(ordered: list[float]) -> float:
    """The median of an already sorted, non-empty list."""
    n = len(ordered)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2.0


_MAX_WINDOW = 512
"""Most samples the short rtt's median looks at (bounded memory and cost per sample)."""
_SLOW_START_ROUND = 8
"""Samples whose fastest one ends slow start when it is clearly slower than the baseline."""
_SLOW_START_QUEUED = 1.25
"""How much slower than the baseline the fastest of them must be: noise of +/-20% around
the baseline never makes every one of 8 samples that slow; queueing does."""


class AIMDLimit:
    """Additive increase, multiplicative decrease (TCP Reno's congestion window).

    - drop (or ``rtt > timeout`` when a timeout is set): ``limit *= backoff`` (default 0.9),
      at most once per round trip: drops of requests admitted before the last decrease are
      ignored, as TCP reacts once per window;
    - success while not app-limited (``in_flight >= limit / 2``): ``limit += increase / limit``,
      i.e. about ``increase`` (default 1) per round trip's worth of samples;
    - bounds ``min_limit`` (default 1) .. ``max_limit`` (default 1000), initial 20.

    AIMD sees only drops, never latency: use it in front of something that refuses when full
    (a downstream with its own limit, a bounded pool), not one that just gets slower.
    """

    __slots__ = (
        "_decreased_at",
        "_value",
        "backoff",
        "increase",
        "max_limit",
        "min_limit",
        "timeout",
    )

    def __init__(
        self,
        initial: int = 20,
        *,
        min_limit: int = 1,
        max_limit: int = 1000,
        backoff: float = 0.9,
        increase: float = 1.0,
        timeout: float | None = None,
    ) -> None:
        if not 1 <= min_limit <= initial <= max_limit:
            raise ValueError("need 1 <= min_limit <= initial <= max_limit")
        if not 0 < backoff < 1:
            raise ValueError("backoff must be in (0, 1)")
        if not 0 < increase < math.inf:  # (NaN too) the limit must be able to grow back
            raise ValueError("increase must be positive and finite")
        if timeout is not None and not 0 < timeout < math.inf:
            raise ValueError("timeout must be None or positive and finite")
        self.min_limit = min_limit
        self.max_limit = max_limit
        self.backoff = backoff
        self.increase = increase
        self.timeout = timeout
        self._value = float(initial)
        self._decreased_at = -math.inf

    @property
    def limit(self) -> int:
        return int(self._value)

    @property
    def adaptive(self) -> bool:
        return True

    def on_sample(self, start_time: float, rtt: float, in_flight: int, dropped: bool) -> int:
        if dropped or (self.timeout is not None and rtt > self.timeout):
            if start_time >= self._decreased_at:
                self._value = max(self.min_limit, self._value * self.backoff)
                self._decreased_at = start_time + rtt
        elif in_flight * 2 >= self._value:
            self._value = min(self.max_limit, self._value + self.increase / self._value)
        return int(self._value)

    def __repr__(self) -> str:
        return f"AIMDLimit(limit={self.limit})"


class _ProbingLimit:
    """Shared machinery of the latency-based limits: smoothed rtt, no-load rtt, re-probing.

    - ``short_rtt`` (what the service looks like now): the *median* rtt of the last two round
      trips of successful samples (``2 * limit``, at least ``short_window``, at most 512),
      recomputed every eighth of a window. A median, not a mean: queueing raises every sample,
      while a pause of the protected process's own host (a CPU shared with other work, a
      collector, a burst of refusals to write) raises the samples in flight during it, often
      by several times the service time; a mean reads that as queueing and cuts the limit
      below the knee, the median does not (``tests/unit/test_admission_limits.py``,
      ``docs/lab.md``). ``long_rtt``: an EWMA of the samples over ``10 * short_window``.
    - ``no_load_rtt`` (the baseline): first the median rtt of a warm-up of
      ``max(probe_samples, 2 * initial)`` samples; then the median rtt measured while the
      limit is pinned to ``probe_ratio * limit`` for ``max(probe_samples, 2 * pinned limit)``
      samples (whole round trips, so the fastest completions do not bias it low). Between
      probes it follows ``long_rtt`` *down* only, and only when it is 10% faster: a faster
      service is noticed at once, a slower one at the next probe. A probe that finds the
      service slower (baseline up by ``slow_start_exit``, up to 1.5x) scales the limit held
      after the previous probe (when the baseline was last known right) by the slowdown, as
      Little's law asks for the same throughput; much slower (over 1.5x) restores that limit
      unscaled. Either way the stale baseline had squeezed it since.
    - Probes start every ``probe_interval`` seconds (of sample start times) times a uniform
      jitter ``1 +/- probe_jitter``, so a fleet does not probe in step; and early, once
      ``early_probe_gap`` no-load round trips after the last, when the limit has been cut
      by ``early_probe_cut`` (20%) since it: a deep cut is either queueing (the probe
      confirms the baseline) or a slowdown queueing did not cause, which only a probe can
      tell. An early probe that confirms the baseline doubles the gap before the next early
      one (up to 8x; any other probe resets it). Cuts are measured from the limit in use
      at the last probe (the most requests seen in flight since the one before, if fewer):
      a limit held through a quiet spell was never in use, and its cut is no news.
    - A probe whose first half of samples already puts the baseline within the slow start
      factor of the last one ends there; one that finds a change takes all its samples.
    - Each algorithm's ``_update`` gives the change over one *round trip*; a round trip
      brings about ``limit`` samples, so each sample applies ``1/limit`` of it (full steps per
      sample overreact long before their effect on latency can be seen).
    - Slow start: until latency first rises (``short_rtt > slow_start_exit * no_load_rtt``,
      1.1, or the fastest of the last 8 samples above 1.25x the baseline, as HyStart reads
      the freshest round's minimum) or a drop, the limit grows by at least half per round
      trip.
    - Drops: ``limit *= drop_backoff`` at most once per round trip; never an rtt sample.
    - App-limited (``in_flight < limit / 2``): decreases apply, increases do not.
    """

    def __init__(
        self,
        initial: int,
        min_limit: int,
        max_limit: int,
        short_window: int,
        probe_interval: float,
        probe_jitter: float,
        probe_samples: int,
        probe_ratio: float,
        drop_backoff: float,
        rng: random.Random | None,
        early_probe_cut: float | None,
        early_probe_gap: float,
    ) -> None:
        if not 1 <= min_limit <= initial <= max_limit:
            raise ValueError("need 1 <= min_limit <= initial <= max_limit")
        if not 0 < probe_ratio < 1:
            raise ValueError("probe_ratio must be in (0, 1)")
        if early_probe_cut is not None and not 0 < early_probe_cut < 1:
            raise ValueError("early_probe_cut must be in (0, 1) or None")
        # Written so NaN fails too: a NaN interval or gap never probes, a NaN backoff turns
        # the limit itself into NaN.
        if not (
            short_window >= 1
            and probe_samples >= 1
            and 0 < probe_interval < math.inf
            and 0 <= probe_jitter < 1
            and 0 < drop_backoff < 1
            and 0 <= early_probe_gap < math.inf
        ):
            raise ValueError(
                "need short_window, probe_samples >= 1; probe_interval finite and > 0; "
                "probe_jitter in [0, 1); drop_backoff in (0, 1); early_probe_gap finite, >= 0"
            )
        self._early_probe_cut = early_probe_cut
        self.early_probe_gap = early_probe_gap
        """Round trips (of the no-load rtt) after a probe before an early one may start."""
        self._early_from = math.inf
        self._early_backoff = 1.0
        self._probe_early = False
        self.min_limit = min_limit
        self.max_limit = max_limit
        self.probe_interval = probe_interval
        self.probe_jitter = probe_jitter
        self.probe_samples = probe_samples
        self.probe_ratio = probe_ratio
        self.drop_backoff = drop_backoff
        self._short_window = max(1, short_window)
        self._recent: deque[float] = deque(maxlen=_MAX_WINDOW)
        self._fresh = 0
        self._rng = rng if rng is not None else random.Random()
        self._value = float(initial)
        self.short_rtt: float | None = None
        self.long_rtt = 0.0
        self._long_alpha = 2.0 / (10 * short_window + 1)
        self.no_load_rtt: float | None = None
        self._next_probe: float | None = None
        self._probe_limit = 0
        self._probe_rtts: list[float] = []
        self._decreased_at = -math.inf
        self._slow_start = True
        self._value_before_probe = float(initial)
        self._cut_below = self._cut_from(self._value_before_probe)
        self._used = 0  # the most requests in flight at once since the last anchor
        self._warmup = 0
        self._warm_rtts: list[float] = []  # kept sorted
        # Whole round trips of samples: the first completions of a batch started together are
        # its fastest ones, and averaging only those would bias the baseline low.
        self._warmup_samples = max(probe_samples, 2 * initial)
        self._fresh_rtts: deque[float] = deque(maxlen=_SLOW_START_ROUND)
        self.slow_start_exit = 1.1
        """Slow start ends once the smoothed rtt exceeds the baseline by this factor (or the
        fastest of the last 8 samples by 1.25x); a probe
        that finds the baseline slower by more scales the limit (see the class docstring)."""

    @property
    def early_probe_cut(self) -> float | None:
        """Probe at once (not at the next scheduled probe) when the limit has been cut by
        this share since the last probe; ``None``: only scheduled probes."""
        return self._early_probe_cut

    @early_probe_cut.setter
    def early_probe_cut(self, cut: float | None) -> None:
        self._early_probe_cut = cut
        self._cut_below = self._cut_from(self._value_before_probe)

    def _cut_from(self, held: float) -> float:
        """The limit below which a cut from ``held`` is deep enough to probe early."""
        cut = self._early_probe_cut
        return -math.inf if cut is None else (1.0 - cut) * held

    @property
    def probing(self) -> bool:
        """True while the limit is pinned low to re-measure the no-load rtt."""
        return self._probe_limit > 0

    @property
    def limit(self) -> int:
        return self._probe_limit or int(self._value)

    @property
    def estimate(self) -> int:
        """The limit the algorithm would use outside a probe."""
        return int(self._value)

    @property
    def adaptive(self) -> bool:
        return True

    def _schedule_probe(self, now: float) -> float:
        jitter = 1.0 + self.probe_jitter * (2.0 * self._rng.random() - 1.0)
        at = self._next_probe = now + self.probe_interval * jitter
        return at

    def on_sample(self, start_time: float, rtt: float, in_flight: int, dropped: bool) -> int:
        # The hot path of every adaptive limit: attributes read once into locals, clamps
        # inline, the probe's own path in a method of its own.
        if self._probe_limit:
            return self._probe_sample(start_time, rtt, in_flight, dropped)
        next_probe = self._next_probe
        if next_probe is None:
            next_probe = self._schedule_probe(start_time)
        if in_flight > self._used:
            self._used = in_flight
        value = self._value
        scheduled = start_time >= next_probe
        # A deep cut since the last probe (`_cut_below`, -inf without early probes) is
        # either queueing (the probe confirms the baseline, nothing changes) or a slowdown
        # that queueing did not cause: the host's CPU contended, a pause, a slower
        # dependency. Only a probe tells them apart, and waiting for the scheduled one (5 s
        # by default) leaves the limit squeezed below the knee all that time.
        if scheduled or (start_time >= self._early_from and value < self._cut_below):
            self._probe_early = not scheduled
            self._probe_limit = max(self.min_limit, int(value * self.probe_ratio))
            self._probe_rtts = []
            return self._probe_limit
        if dropped:  # never feeds rtt; back off at most once per round trip
            self._slow_start = False
            if start_time >= self._decreased_at:
                self._value = max(self.min_limit, value * self.drop_backoff)
                self._decreased_at = start_time + rtt
            return int(self._value)
        recent = self._recent
        recent.append(rtt)
        short = self.short_rtt
        if short is None:
            short = long_rtt = rtt
        else:
            long_rtt = self.long_rtt
            long_rtt += self._long_alpha * (rtt - long_rtt)
            n = len(recent)
            window = self._short_window
            if n >= window:
                fresh = self._fresh + 1
                w = 2 * int(value)
                if w < window:
                    w = window
                if w > n:
                    w = n
                if fresh * 8 >= w:
                    self._fresh = 0
                    if w == n:
                        ordered = sorted(recent)
                    else:
                        # The newest w samples, taken from the newest end (a deque walks from
                        # its oldest end to an index) and put back in arrival order, so
                        # the sort sees what it always saw, NaN and all.
                        ordered = list(islice(reversed(recent), w))
                        ordered.reverse()
                        ordered.sort()
                    short = (ordered[(w - 1) // 2] + ordered[w // 2]) / 2.0
                else:
                    self._fresh = fresh
        self.long_rtt = long_rtt
        self.short_rtt = short
        base = self.no_load_rtt
        if self._warmup < self._warmup_samples:
            # Warm-up: the first samples (at the initial, low limit) are the first probe.
            self._warmup += 1
            bisect.insort(self._warm_rtts, rtt)
            base = self.no_load_rtt = _median(self._warm_rtts)
            if self._warmup == self._warmup_samples:  # the warm-up counts as the first probe
                self._anchored(start_time + rtt, base)
        elif base is None or long_rtt < 0.9 * base:
            # Follow a clearly faster service down at once, on the slow average and only past
            # a 10% margin: tracking every dip (a running minimum) would drag the baseline
            # below the true no-load rtt by the noise, and read that noise as queueing.
            base = self.no_load_rtt = long_rtt
        slow_start = self._slow_start
        if slow_start:
            # HyStart (RFC 9406): the fastest of the last few samples, not the median of two
            # round trips, ends slow start; the median lags while the limit grows by half per
            # round trip, and lets in a burst far past the knee. The newest is among them: when
            # it is not slow, their fastest is not either (no need to look at all 8).
            fresh_rtts = self._fresh_rtts
            fresh_rtts.append(rtt)
            queued = base * _SLOW_START_QUEUED
            if (
                not rtt <= queued
                and len(fresh_rtts) == _SLOW_START_ROUND
                and min(fresh_rtts) > queued
            ):
                slow_start = self._slow_start = False
                fresh_rtts.clear()
        delta = self._update(value, short, base)
        if delta > 0:
            if in_flight * 2 < value:  # app-limited: no evidence for a higher limit
                return int(value)
            if slow_start and short < base * self.slow_start_exit:
                # Slow start (TCP's): grow by half per round trip until latency first rises.
                half = value * 0.5
                if half > delta:
                    delta = half
        else:
            self._slow_start = False
        # The change is per round trip; a round trip brings about `limit` samples, so each
        # applies 1/limit of it. Per-sample full steps overreact before the feedback arrives.
        value += delta / value
        low = self.min_limit
        high = self.max_limit
        self._value = value = low if value < low else high if value > high else value
        return int(value)

    def _probe_sample(self, start_time: float, rtt: float, in_flight: int, dropped: bool) -> int:
        """One sample while the limit is pinned low: the probe's rtt, until it ends."""
        if not dropped and in_flight <= self._probe_limit:
            probe = self._probe_rtts
            probe.append(rtt)
            n = len(probe)
            confirmed = n == max(self.probe_samples // 2, 2 * self._probe_limit) and (
                self._confirms(probe)
            )
            if confirmed or n >= max(self.probe_samples, 2 * self._probe_limit):
                probe.sort()
                old = self.no_load_rtt
                new = _median(probe)
                if confirmed and old is not None:
                    # A short probe's median is noisier: it moves the baseline halfway.
                    new = (old + new) / 2.0
                self.no_load_rtt = new
                self.short_rtt = self.long_rtt = new
                self._recent.clear()  # the short window starts again from the baseline
                self._fresh = 0
                self._probe_limit = 0
                self._warmup = self._warmup_samples  # a probe completes any warm-up
                if old is not None and new > 1.5 * old:
                    # The service got slower, and the stale baseline read the slowdown as
                    # queueing and squeezed the limit. Return to the limit held before
                    # (when the baseline was right); if the knee really moved, the
                    # gradient takes it down again within a few round trips.
                    self._value = max(self._value, self._value_before_probe)
                elif old is not None and new > self.slow_start_exit * old:
                    # Slower, but not much: Little's law says the throughput the limit
                    # held before carried now needs ``new / old`` times as many in
                    # flight (a host lagging every request, say). Scale it once, and let
                    # the gradient take it from there. Not a new slow start: a probe's
                    # median is itself noisy, and a search restarted on that noise
                    # overshoots far past the knee before its feedback comes back.
                    scaled = self._value_before_probe * new / old
                    self._value = min(self.max_limit, max(self._value, scaled))
                # An early probe that found the baseline where it was says the cut was
                # queueing: the next early one waits twice as long (up to 8x), so a
                # limit settling onto its knee is not pinned low again and again.
                if self._probe_early and old is not None and new <= self.slow_start_exit * old:
                    self._early_backoff = min(8.0, self._early_backoff * 2.0)
                else:
                    self._early_backoff = 1.0
                self._anchored(start_time + rtt, new)
                self._schedule_probe(start_time + rtt)
        return self.limit

    def _confirms(self, probe: list[float]) -> bool:
        """Half a probe's samples already put the baseline where it was (within the slow
        start factor): end it there. Every sample of a probe is served at half the limit,
        and most probes confirm; one that finds a change takes all its samples."""
        old = self.no_load_rtt
        if old is None:
            return False
        median = _median(sorted(probe))
        return old / self.slow_start_exit <= median <= old * self.slow_start_exit

    def _anchored(self, at: float, base: float) -> None:
        """The baseline was just measured (a probe or the warm-up ended at ``at``): the limit
        held now is the one later cuts are measured from, and early probes wait a while."""
        self._warm_rtts = []
        # The limit in use, not a value no load has reached (a limit held through a quiet
        # spell): a cut from one never used is no sign of a slowdown.
        used = float(max(self.min_limit, self._used))
        self._value_before_probe = held = min(self._value, used)
        self._cut_below = self._cut_from(held)
        self._used = 0
        self._early_from = at + self.early_probe_gap * self._early_backoff * base

    def _update(self, limit: float, short_rtt: float, no_load_rtt: float) -> float:
        """The change of the limit over one round trip."""
        raise NotImplementedError


class Gradient2Limit(_ProbingLimit):
    """Gradient limit (after Netflix's Gradient2): track the ratio of no-load to current rtt.

    ``gradient = clamp(tolerance * no_load_rtt / short_rtt, 0.5, 1.0)``;
    ``new = limit * gradient + queue_size``;
    per round trip ``limit += smoothing * (new - limit)``.

    At equilibrium latency is ``tolerance`` times the no-load rtt: for a server whose latency
    grows linearly past its knee, ``limit ~ tolerance * knee + queue_size`` (about 1.1x the
    knee). The gradient never cuts more than half per round trip (outliers) and never exceeds
    1 (a faster rtt than baseline is no reason to grow faster). ``tolerance`` > 1 absorbs
    noise: a baseline measured from a few samples is a little low. Defaults: initial 20,
    bounds 1..1000, ``tolerance`` 1.1, ``queue_size`` ``clamp(limit / 10, 1, 4)`` (Netflix
    uses 4; at small limits 4, or even 2, requests of queue is a large overshoot: in front
    of 8 slots of 20 ms, each request of standing queue adds 2.5 ms to every success),
    ``smoothing`` 0.2, ``short_window`` 10 samples, probe every 5 s +/- 15% (and early after
    a cut of 20%) at half the limit for at least 20 samples, drop backoff 0.9.

    Unlike Netflix's version the baseline is the *probed* no-load rtt, not a 600-sample
    average of the rtt itself: an average drifts up with sustained queueing and lets the limit
    ratchet; the probe re-anchors it.
    """

    def __init__(
        self,
        initial: int = 20,
        *,
        min_limit: int = 1,
        max_limit: int = 1000,
        tolerance: float = 1.1,
        queue_size: float | None = None,
        smoothing: float = 0.2,
        short_window: int = 10,
        probe_interval: float = 5.0,
        probe_jitter: float = 0.15,
        probe_samples: int = 20,
        probe_ratio: float = 0.5,
        drop_backoff: float = 0.9,
        rng: random.Random | None = None,
        early_probe_cut: float | None = 0.2,
        early_probe_gap: float = 20.0,
    ) -> None:
        super().__init__(
            initial,
            min_limit,
            max_limit,
            short_window,
            probe_interval,
            probe_jitter,
            probe_samples,
            probe_ratio,
            drop_backoff,
            rng,
            early_probe_cut,
            early_probe_gap,
        )
        if not 1.0 <= tolerance < math.inf:
            raise ValueError("tolerance must be finite and >= 1.0")
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        if queue_size is not None and not 0 <= queue_size < math.inf:
            raise ValueError("queue_size must be None or finite and >= 0")
        self.tolerance = tolerance
        self.queue_size = queue_size
        """Standing queue allowed past the knee; ``None``: ``clamp(limit / 10, 1, 4)``."""
        self.smoothing = smoothing

    def _update(self, limit: float, short_rtt: float, no_load_rtt: float) -> float:
        # an rtt of 0.0 (a coarse clock, virtual time) is no queueing, not a division by zero
        if short_rtt > 0:
            gradient = self.tolerance * no_load_rtt / short_rtt
            gradient = 0.5 if gradient < 0.5 else 1.0 if gradient > 1.0 else gradient
        else:
            gradient = 1.0
        queue = self.queue_size
        if queue is None:
            queue = limit * 0.1
            queue = 1.0 if queue < 1.0 else 4.0 if queue > 4.0 else queue
        return self.smoothing * (limit * gradient + queue - limit)

    def __repr__(self) -> str:
        return f"Gradient2Limit(limit={self.limit})"


class VegasLimit(_ProbingLimit):
    """TCP Vegas-style limit: estimate the queue and keep it between alpha and beta.

    ``queue = limit * (1 - no_load_rtt / short_rtt)`` requests are waiting somewhere; with
    ``t = log10(limit)`` (1 below 10), per round trip: queue <= t: grow by ``3 t`` (nothing
    queued); queue < ``alpha = 3 t``: grow by ``t``; queue > ``beta = 6 t``: shrink by ``t``;
    else hold; each step times ``smoothing``. At equilibrium ``alpha..beta`` requests queue
    past the knee: ``limit ~ knee + 6..12`` at a knee of 100. Defaults: initial 20, bounds
    1..1000, smoothing 1.0, short window 10, probe every 5 s +/- 15% (and early after a cut
    of 20%) at half the limit for at least 20 samples, drop backoff 0.9. (Netflix applies
    these steps per *sample* and grows by beta when nothing is queued; per round trip, as TCP
    Vegas does, is stable.)
    """

    def __init__(
        self,
        initial: int = 20,
        *,
        min_limit: int = 1,
        max_limit: int = 1000,
        smoothing: float = 1.0,
        short_window: int = 10,
        probe_interval: float = 5.0,
        probe_jitter: float = 0.15,
        probe_samples: int = 20,
        probe_ratio: float = 0.5,
        drop_backoff: float = 0.9,
        rng: random.Random | None = None,
        early_probe_cut: float | None = 0.2,
        early_probe_gap: float = 20.0,
    ) -> None:
        super().__init__(
            initial,
            min_limit,
            max_limit,
            short_window,
            probe_interval,
            probe_jitter,
            probe_samples,
            probe_ratio,
            drop_backoff,
            rng,
            early_probe_cut,
            early_probe_gap,
        )
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        self.smoothing = smoothing

    def _update(self, limit: float, short_rtt: float, no_load_rtt: float) -> float:
        t = math.log10(limit) if limit > 10 else 1.0
        # an rtt of 0.0 (a coarse clock, virtual time) is no queueing, not a division by zero
        queue = limit * (1.0 - no_load_rtt / short_rtt) if short_rtt > 0 else 0.0
        if queue <= t:
            step = 3 * t
        elif queue < 3 * t:
            step = t
        elif queue > 6 * t:
            step = -t
        else:
            return 0.0
        return self.smoothing * step

    def __repr__(self) -> str:
        return f"VegasLimit(limit={self.limit})"
