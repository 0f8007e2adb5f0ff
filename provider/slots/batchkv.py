"""A model's batch KV: what one request must reserve so the model's whole batch stays covered.

Why: mlx-lm's `BatchKVCache` (0.32.2: `merge`, `extend`, `update_and_fetch`, `filter`) keeps the
batch as one left-padded `(B, kv_heads, T, head_dim)` array per layer, T = the longest member's
length in 256-token blocks. A short request beside a long one costs kv(T_long), and a long one
joining N short ones grows all of them. Per-request sizes under-count that by up to N×.

The rule (`join_share`, the only place it lives; fast admission and `ModelManager._reserve_kv`
both call it). For request r joining model m whose book holds N members, reserved bytes Σ and
high-water length H (the longest reserved span since m's batch was last empty):
    T = max(tokens(r), H);   share(r) = max(kv(r), (N+1)·kv(T) − Σ)
On a departure (`KvBook.release`) the leaver's bytes are released except what the remaining n
members still need: keep = clamp(n·kv(H) − Σ_rest, 0, leaver's bytes), held under the leaver's
ledger id as residue; a surplus is given back (residue first, then members' shares down to their
own KV); everything goes when the book is empty. So Σ = n·kv(H) exactly, after every event.

Why it holds — invariant I: Σ (members + residue) ≥ n·kv(H), and the batch holds at most n·kv(H):
* members' lengths never exceed their reserved tokens (output is capped at what was reserved), so
  the padded batch (prompt batch + generation batch, before or after `extend`) is ≤ n·kv(H);
* a join makes Σ' = max(Σ + kv(r), (N+1)·kv(T)) = (N+1)·kv(H'), H' = T (as Σ = N·kv(H) and
  kv(r) ≤ kv(T)): I holds, with equality;
* a departure: `filter` gathers the kept rows and then only slices the padding off, so the old
  T-long buffer stays alive until the next growth or `extend` — hence H is not lowered while the
  batch lives; keep restores Σ_rest = n·kv(H) (keep ≤ the leaver's bytes, as Σ was (n+1)·kv(H)),
  and a surplus is trimmable down to n·kv(H) because Σ own KV ≤ n·kv(H);
* the book empties only when every member has left the batch: the arrays are gone, H resets.
Transient copies while `extend`/`update_and_fetch` concatenate are working memory (the activation
reserve), as for any other MLX op. The price: until m's batch drains, H stays at the longest
member's span, so later short requests reserve rows of that length (the filtered buffer may still
be that long; the engine does not say when it re-grows), and a residue keeps its `kv:<request id>`
ledger entry (a reuse of that id is refused as a duplicate until then).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from memory import Ledger, Rejection, ReservationKind
from memory.ledger import Lease
from memory.snapshot import MemorySnapshot
from provider.models import KvLayout, kv_bytes_for_tokens


@dataclass(frozen=True, slots=True)
class KvNeed:
    """The KV one request reserves (admission.kv_need sizes it)."""

    tokens: int  # prompt + output after the context clamp
    max_tokens: int  # output tokens budgeted
    nbytes: int


@dataclass(frozen=True, slots=True)
class KvHold:
    """What one in-flight request has reserved on a model."""

    tokens: int  # prompt + output, clamped to the context window
    max_tokens: int  # the output part
    nbytes: int = 0  # its ledger reservation (its share of the batch)
    booked_at: float = 0.0  # monotonic: when it was reserved (how far along it may be, for feasible_after_ms)


@dataclass(frozen=True, slots=True)
class BatchKv:
    """A model's in-flight KV as reserved, at one instant (what `join_share` reads)."""

    members: int = 0  # requests holding a reservation (waiting for, or in, the batch)
    high_tokens: int = 0  # longest reserved span since the batch was last empty
    reserved_bytes: int = 0  # Σ ledger bytes held for the model: members + residue


EMPTY = BatchKv()


def batch_bytes(layout: KvLayout, members: int, tokens: int) -> int:
    """The padded batch's KV: `members` rows of `tokens` (in 256-token blocks)."""
    return members * kv_bytes_for_tokens(layout, tokens) if members > 0 else 0


def join_share(layout: KvLayout, own_tokens: int, own_bytes: int, batch: BatchKv) -> int:
    """Bytes a request of `own_tokens` (`own_bytes` alone) must reserve to join `batch`."""
    tokens = max(own_tokens, batch.high_tokens)
    return max(own_bytes, batch_bytes(layout, batch.members + 1, tokens) - batch.reserved_bytes)


def departure_keep(layout: KvLayout, rest: BatchKv, leaving_bytes: int) -> int:
    """Bytes of a leaver's reservation the remaining members `rest` still need (0 when empty)."""
    if rest.members == 0:
        return 0
    deficit = batch_bytes(layout, rest.members, rest.high_tokens) - rest.reserved_bytes
    return min(max(0, deficit), leaving_bytes)


class KvBook:
    """One model's KV reservations in the ledger: join and departure under one lock, so the loop
    (joins) and the engine thread (departures) never compute a share on a half-updated book."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: dict[str, tuple[str, KvHold]] = {}  # request id -> (ledger id, hold)
        self._residue: dict[str, int] = {}  # ledger id -> bytes kept after its request left
        self._high = 0
        self._reserved = 0

    def view(self) -> BatchKv:
        with self._lock:
            return BatchKv(len(self._holds), self._high, self._reserved)

    def holds(self) -> list[KvHold]:
        with self._lock:
            return [hold for _, hold in self._holds.values()]

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._holds)

    def reserve(self, ledger: Ledger, layout: KvLayout, request_id: str, ledger_id: str, tokens: int,
                max_tokens: int, own_bytes: int, *, snapshot: MemorySnapshot | None = None,
                donor: str | None = None, donated: int = 0) -> tuple[Lease | Rejection, int]:
        """Reserve the request's share of the batch; returns the ledger's answer and the share.
        `donor`/`donated` as in `Ledger.reserve` (a loading model's claim giving its KV part)."""
        with self._lock:
            share = join_share(layout, tokens, own_bytes, BatchKv(len(self._holds), self._high, self._reserved))
            result = ledger.reserve(ledger_id, ReservationKind.REQUEST_KV, share, snapshot=snapshot,
                                    donor=donor, donated=min(donated, share))
            if not isinstance(result, Rejection):
                self._holds[request_id] = (ledger_id, KvHold(tokens, max_tokens, share, time.monotonic()))
                self._high = max(self._high, tokens)
                self._reserved += share
            return result, share

    def top_up(self, ledger: Ledger, layout: KvLayout, ledger_id: str, *,
               snapshot: MemorySnapshot | None = None) -> bool:
        """After a model's KV bytes per token were measured higher than estimated (its requests'
        KV was reserved at the estimate), reserve what its booked requests now lack, held as residue
        until the batch drains. False when the ledger cannot give it (nothing is reserved then)."""
        with self._lock:
            deficit = batch_bytes(layout, len(self._holds), self._high) - self._reserved
            if deficit <= 0 or not self._holds:
                return True
            result = ledger.reserve(ledger_id, ReservationKind.REQUEST_KV, deficit, snapshot=snapshot)
            if isinstance(result, Rejection):
                return False
            self._residue[ledger_id] = self._residue.get(ledger_id, 0) + deficit
            self._reserved += deficit
            return True

    def release(self, ledger: Ledger, layout: KvLayout, request_id: str) -> None:
        """The request left the batch: release its bytes but what the rest still needs."""
        with self._lock:
            entry = self._holds.pop(request_id, None)
            if entry is None:
                return
            ledger_id, hold = entry
            self._reserved -= hold.nbytes
            if not self._holds:  # the batch is empty: its arrays are gone
                ledger.release(ledger_id)
                for rid in self._residue:
                    ledger.release(rid)
                self._residue.clear()
                self._high = self._reserved = 0
                return
            rest = BatchKv(len(self._holds), self._high, self._reserved)
            keep = departure_keep(layout, rest, hold.nbytes)
            if keep > 0:
                ledger.reduce(ledger_id, hold.nbytes - keep)
                self._residue[ledger_id] = keep
                self._reserved += keep
                return
            ledger.release(ledger_id)
            self._trim(ledger, layout, self._reserved - batch_bytes(layout, rest.members, self._high))

    def _trim(self, ledger: Ledger, layout: KvLayout, surplus: int) -> None:
        """Give back what the smaller batch no longer needs: residue first, then members' shares
        down to their own KV (a later departure re-keeps what is then needed)."""
        for rid in list(self._residue):
            if surplus <= 0:
                return
            cut = min(surplus, self._residue[rid])
            if cut == self._residue[rid]:
                ledger.release(rid)
                del self._residue[rid]
            else:
                ledger.reduce(rid, cut)
                self._residue[rid] -= cut
            self._reserved -= cut
            surplus -= cut
        for request_id, (ledger_id, hold) in sorted(self._holds.items(), key=lambda kv: -kv[1][1].nbytes):
            if surplus <= 0:
                return
            cut = min(surplus, hold.nbytes - kv_bytes_for_tokens(layout, hold.tokens))
            if cut > 0:
                ledger.reduce(ledger_id, cut)
                self._holds[request_id] = (ledger_id, replace(hold, nbytes=hold.nbytes - cut))
                self._reserved -= cut
                surplus -= cut
