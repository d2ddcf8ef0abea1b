"""The T_hide admission rule of a streamed L3 tail: pure, no SGLang, no torch.

A request whose tail still streams is admitted once the rest of its read is predicted to hide under the prefill of
its own suffix. The forward computes layer by layer and the tail lands read group by read group (``shares``:
``rules.read_groups``; even over ``groups`` where not given), so group k is needed only once the forward computed
the layers before it. The forward runs ``c = suffix_compute_s + interference_s``: the prefill model's time plus
what the landing costs it (the bind rule's learned ``k`` x the tail's bytes):

    READY  when  stall_s(shares, remaining_bytes / read_rate, c, landed, first=1)  <=  0

i.e. no read group after the first lands later than the forward needs it (group 0 is the forward's to wait on
either way, unless it is the only one). ``landed`` is the tail's share already landed (at least group 0's once it
landed). Before group 0 landed on every page only the last group is checked: counted from now, the forward cannot
compute before group 0 lands.

The read rate is the stream's own, counted between landings once a second one landed; before that it also holds
the read's set-up, so once group 0 landed the higher of it and the store's measured bandwidth (``device_rate_Bps``)
is taken. A device that stalls after admission is the forward's to wait on, to the tail's deadline (then the
request is retracted). Without a read rate or a prefill model the rule falls back to its safe minimum: READY once
group 0 landed on every tail page.

DROP (the request computes the tail itself) when a group FAILED before admission (nothing unverified is admitted);
when waiting is predicted slower than recomputing tail + suffix (``full_compute_s``, given only with the cost policy
on: otherwise a tail is waited for, as a hit loaded whole); or when the tail waited past its deadline (SGLang's own
prefetch budget). ``busy`` (another request runs or waits on the engine): READY only once landed whole, as a hit
loaded whole, since a stall or the landing's interference would cost the whole batch.

Every caller MIN-reduces the flags over the ranks (``ready`` and ``keep`` are ANDed), so the rule may read local
clocks and rates.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from sgl_kvtier.experiments.streaming.rules.read_groups import check_shares, or_even, stall_s


class Verdict(enum.Enum):
    """The gate's answer for one tail at one poll."""

    WAIT = "wait"  # not yet: the request is skipped this round (not blocking the queue)
    READY = "ready"  # admit: the next match reports the tail as a host hit
    DROP = "drop"  # give the tail up: the request computes it


@dataclass(frozen=True)
class GateInputs:
    """One tail at one admission poll."""

    groups: int  # layer groups per page (G >= 1)
    remaining_bytes: int  # tail bytes not landed yet
    group0_landed: bool  # group 0 verified on every tail page
    failed: bool  # some tail page failed some group
    waited_s: float  # since the tail was registered
    deadline_s: float  # give up after this long at the gate
    read_rate_Bps: float | None = None  # measured on this stream (None: too early)
    rate_settled: bool = True  # read_rate_Bps is counted between landings (False: from the thread's start)
    device_rate_Bps: float | None = None  # the store's measured read bandwidth (None: not measured)
    suffix_compute_s: float | None = None  # predicted prefill of the tokens after the tail (None: no model)
    full_compute_s: float | None = None  # predicted prefill of tail + suffix (None: no model, or no cost policy)
    interference_s: float = 0.0  # what the landing adds to the forward (learned k x tail bytes; 0: unknown)
    busy: bool = False  # another request runs or waits on the engine: admitted only once landed whole
    shares: tuple[float, ...] = ()  # each read group's share of the tail's layers ((): even over ``groups``)
    tail_bytes: int = 0  # the tail's bytes, landed or not (0: unknown; then only group 0 counts as landed)

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        if self.remaining_bytes < 0:
            raise ValueError(f"remaining_bytes must be >= 0, got {self.remaining_bytes}")
        if not self.interference_s >= 0:
            raise ValueError(f"interference_s must be >= 0, got {self.interference_s}")
        check_shares(self.shares, self.groups)

    def group_shares(self) -> tuple[float, ...]:
        """Each read group's share of the tail (even over ``groups`` where ``shares`` is not given)."""
        return or_even(self.shares, self.groups)

    def landed_share(self) -> float:
        """The tail's share already landed: from its bytes where known, at least group 0's once it landed."""
        group0 = self.group_shares()[0] if self.group0_landed else 0.0
        if self.tail_bytes <= 0:
            return group0
        return min(1.0, max(group0, 1.0 - self.remaining_bytes / self.tail_bytes))

    def forward_s(self) -> float | None:
        """The streamed forward's predicted seconds ``c``: the suffix's compute plus the interference."""
        if self.suffix_compute_s is None:
            return None
        return max(self.suffix_compute_s, 0.0) + self.interference_s


def _usable(rate: float | None) -> float | None:
    return rate if rate is not None and rate > 0 and not math.isnan(rate) else None


def read_rate_Bps(inputs: GateInputs) -> float | None:
    """The rate the rest of the tail is predicted to land at (None: no rate yet): the stream's once settled;
    before that, once group 0 landed, the higher of the stream's and the store's measured bandwidth."""
    rate, device = _usable(inputs.read_rate_Bps), _usable(inputs.device_rate_Bps)
    if inputs.rate_settled or not inputs.group0_landed or device is None:
        return rate
    return device if rate is None else max(rate, device)


def predicted_read_s(inputs: GateInputs) -> float | None:
    """Seconds until the rest of the tail has landed, at ``read_rate_Bps`` (None: no rate yet)."""
    if inputs.remaining_bytes == 0:
        return 0.0
    rate = read_rate_Bps(inputs)
    return None if rate is None else inputs.remaining_bytes / rate


def stall_after_admission_s(inputs: GateInputs, read_s: float, compute_s: float) -> float:
    """How long a forward admitted now waits on the read groups after the first (module docstring)."""
    group_shares = inputs.group_shares()
    first = min(1, len(group_shares) - 1) if inputs.group0_landed else len(group_shares) - 1
    return stall_s(group_shares, read_s, compute_s, inputs.landed_share(), first=first)


def decide(inputs: GateInputs) -> Verdict:
    """The local verdict for one tail (the caller MIN-reduces ``ready`` / ``keep`` over the ranks)."""
    if inputs.failed:
        return Verdict.DROP
    if inputs.remaining_bytes == 0:
        return Verdict.READY  # everything landed and verified: nothing left to hide
    if inputs.waited_s >= inputs.deadline_s:
        return Verdict.DROP
    if inputs.busy:
        return Verdict.WAIT  # admitted once landed whole (above), as a hit loaded whole
    read_s, compute = predicted_read_s(inputs), inputs.forward_s()
    if read_s is None or compute is None:
        return Verdict.READY if inputs.group0_landed else Verdict.WAIT  # unmeasured: the safe minimum
    stall = stall_after_admission_s(inputs, read_s, compute)
    if stall <= 1e-9:
        return Verdict.READY
    if inputs.full_compute_s is not None and compute + stall > inputs.full_compute_s:
        return Verdict.DROP  # recomputing the tail is predicted faster than waiting for it
    return Verdict.WAIT
