"""provider/slots/batchkv: the batch KV rule against a pure model of mlx-lm's padded batch. No MLX.

The model of one model's batch (mlx-lm 0.32.2 BatchKVCache): n rows of the longest member's
length in 256-token blocks; a departure only slices the padding off the gathered rows, so the old
long buffer may stay until the batch re-grows — the model keeps it (worst case) until the batch is
empty. After every join and every departure the ledger's request_kv bytes must cover
n × kv(T_buffer), and an empty batch must leave the ledger empty.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from admission_figures import FIG, model, snap, view
from memory import GiB, Ledger, MemorySnapshot, ReservationKind
from provider.models import kv_bytes_for_tokens
from provider.slots import Admitted, ModelState, Refused, SlotView, decide, join_share
from provider.slots.batchkv import BatchKv, KvBook

MiB = 2**20
INFO = model("m", GiB, per_token=4096, context=8192)  # 1 MiB per 256-token block
SNAP = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB, mlx_active_bytes=GiB)

# an event: ("join", tokens) or ("leave", index into the members, modulo their count)
events = st.lists(st.one_of(st.tuples(st.just("join"), st.integers(1, 8192)),
                            st.tuples(st.just("leave"), st.integers(0, 63))), max_size=40)


def request_kv(ledger: Ledger) -> int:
    return ledger.snapshot().bytes_by_kind[ReservationKind.REQUEST_KV]


@settings(max_examples=300, deadline=None)
@given(events)
def test_reservations_cover_the_padded_batch_across_joins_and_departures(seq):
    ledger = Ledger(FIG)
    book = KvBook()
    members: dict[str, int] = {}  # request id -> tokens
    buffer_tokens = 0  # the batch's array length (worst case: kept until the batch is empty)
    for step, (kind, arg) in enumerate(seq):
        if kind == "join":
            own = kv_bytes_for_tokens(INFO.kv, arg)
            before = request_kv(ledger)
            result, share = book.reserve(ledger, INFO.kv, f"r{step}", f"kv:r{step}", arg, 0, own, snapshot=SNAP)
            assert result.granted and share >= own
            assert request_kv(ledger) == before + share
            members[f"r{step}"] = arg
            buffer_tokens = max(buffer_tokens, arg)
        elif members:
            rid = sorted(members)[arg % len(members)]
            del members[rid]
            book.release(ledger, INFO.kv, rid)
            book.release(ledger, INFO.kv, rid)  # a second release is a no-op
            if not members:
                buffer_tokens = 0
        footprint = len(members) * kv_bytes_for_tokens(INFO.kv, buffer_tokens) if members else 0
        assert request_kv(ledger) >= footprint, (step, members, buffer_tokens)  # the cap promise
        assert request_kv(ledger) == footprint  # and not a byte more than the worst case
        assert book.view() == BatchKv(len(members), buffer_tokens, request_kv(ledger))
        assert all(h.nbytes >= kv_bytes_for_tokens(INFO.kv, h.tokens) for h in book.holds())
    for rid in list(members):
        book.release(ledger, INFO.kv, rid)
    assert len(ledger) == 0 and book.view() == BatchKv()


def test_join_share_examples():
    kv = INFO.kv
    block = kv_bytes_for_tokens(kv, 256)
    assert block == MiB
    assert join_share(kv, 100, block, BatchKv()) == block  # alone: its own KV
    # a short one beside a 2048-token one costs the long one's rows
    assert join_share(kv, 100, block, BatchKv(1, 2048, 8 * block)) == 8 * block
    # a long one joining 3 short ones grows all four
    assert join_share(kv, 2048, 8 * block, BatchKv(3, 256, 3 * block)) == 4 * 8 * block - 3 * block


def test_decide_sizes_a_resident_request_by_its_batch_share():
    """Same memory, same ledger: a short request is admitted beside an empty batch, refused
    (token_budget) beside one 8192-token request, because its row is padded to 8192 tokens."""
    big = model("big", GiB, per_token=256 * 1024, context=8192)  # kv(8192) = 2 GiB
    own = kv_bytes_for_tokens(big.kv, 64)
    empty = SlotView("big", ModelState.LOADED, True, 0.0, GiB)
    long_batch = SlotView("big", ModelState.LOADED, True, 0.0, GiB, BatchKv(1, 8192, 2 * GiB))
    s = snap(empty)
    outstanding = 7 * GiB + GiB // 2  # 2 GiB of it the long request's KV
    free = FIG.available_bytes(s, outstanding)
    share = join_share(big.kv, 64, own, long_batch.kv)
    assert share == 2 * GiB and own < free < share
    for slot_view, admitted in ((empty, True), (long_batch, False)):
        v = view(slot_view, outstanding=outstanding, request_kv=2 * GiB)
        answer = decide(v, FIG, s, model_id="big", info=big, prompt_tokens=32, max_tokens=32)
        assert isinstance(answer, Admitted) is admitted
        if not admitted:
            assert isinstance(answer, Refused) and answer.rejection_reason.value == "token_budget"
