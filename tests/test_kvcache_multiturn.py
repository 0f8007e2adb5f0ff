"""Multi-turn reuse of the whole conversation, on the real engine and tiny model.

When a request finishes, the engine keeps the KV of its whole sequence (prompt + generated tokens,
as mlx-lm's batch cache holds them) in the RAM tier and the SSD tier. The next turn's templated
prompt repeats that sequence and goes on, so it reuses all of it; the reuse is matched on tokens,
so a template that re-renders an earlier answer differently reuses only up to the first token that
differs. Greedy outputs must be identical to a run with the cache off, and the reused counts are
read from the cache's own stats (`PrefixCacheStats.reused_tokens`).

About the answer's leading space: mlx-lm's streaming detokenizer drops a leading space from an
answer (mlx_lm.server does the same), and the tiny random models start most answers with a
space-led token, which a trained chat model rarely does. So a client that sends the answer text
back makes the template render a different first answer token. The `Conversation` here keeps the
answer as the tokenizer decodes it (`Keep.DECODED`), so the template renders the generated
tokens back; `Keep.API_TEXT` is the trimmed text, one of the re-rendering cases below.
"""

from __future__ import annotations

import asyncio
import enum
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine_arithmetic import assert_decisive_continuation
from kvcache.disk import DiskBudget
from kvcache.manager import REUSE_MIN_TOKENS, KvCacheManager, Tier
from kvcache.ssd import SsdStore
from memory.ledger import Ledger, ReservationKind
from memory.policy import GiB, figures
from memory.snapshot import MemorySnapshot
from next_turn import NextTurnTrace
from provider.engine import ChatRequest, Engine, Finished, SamplingParams

IDLE = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB)
PARAMS = SamplingParams(max_tokens=12, temperature=0.0)
SYSTEM = {"role": "system", "content": "a patient helper who answers the river questions"}
USER_TURNS = ["hello there", "tell me about seven apples", "and the blue mountain", "one more thing"]

# Qwen3-style: the generation prompt opens an empty think block that earlier assistant turns do
# not show, so the re-rendered turn differs inside the previous prompt's tail.
THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{% endif %}"
)
# Earlier answers are shown shortened (as templates that drop an answer's reasoning do), so the
# re-rendered turn differs in the middle of the previous answer.
SHORTENED_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] if message['role'] != 'assistant'"
    " else message['content'][: message['content'] | length // 2] %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Keep(enum.Enum):
    """What the client puts back into the history as the assistant's answer."""

    DECODED = "decoded"  # the tokenizer's decoding of the generated tokens
    API_TEXT = "api_text"  # the text the engine streamed (leading space dropped)


_LOADED: dict[Path, tuple] = {}


def loaded(model_path: Path) -> tuple:
    if model_path not in _LOADED:
        _LOADED[model_path] = mlx_lm.load(str(model_path))
    return _LOADED[model_path]


def tokenizer(model_path: Path):
    return loaded(model_path)[1]


def templated(model_path: Path, messages) -> list[int]:
    return list(tokenizer(model_path).apply_chat_template(messages, add_generation_prompt=True))


class Conversation:
    """One chat run turn by turn; records what each turn sent and got."""

    def __init__(self, name: str, model_path: Path, *, keep: Keep = Keep.DECODED, first_user: str = "") -> None:
        self.name = name
        self.model_path = model_path
        self.keep = keep
        self.history: list[dict[str, str]] = [SYSTEM]
        self.users = [first_user + u for u in USER_TURNS]
        self.turns: list[tuple[int, tuple[int, ...], str]] = []  # (prompt tokens, completion ids, text)
        self.prompts: list[list[int]] = []  # each turn's templated prompt

    def next_messages(self) -> list[dict[str, str]]:
        return self.history + [{"role": "user", "content": self.users[len(self.turns)]}]

    def sequence(self, n: int) -> list[int]:
        """Turn n's prompt + answer: the tokens its KV was computed for."""
        return self.prompts[n] + list(self.turns[n][1])

    def assert_decisive(self) -> None:
        """Each answer's greedy choices are no near-tie: reuse splits the prefill another way, and the
        tests compare the answers with a run that reuses nothing (engine_arithmetic.py)."""
        model, _ = loaded(self.model_path)
        for n, (prompt, (_, answer, _)) in enumerate(zip(self.prompts, self.turns)):
            assert_decisive_continuation(model, prompt, answer, f"{self.name} turn {n}")

    async def turn(self, engine: Engine, model_id: str) -> Finished:
        messages = self.next_messages()
        text, fin = await engine.submit(model_id, ChatRequest(f"{self.name}-{len(self.turns)}", messages,
                                                              PARAMS)).collect()
        assert isinstance(fin, Finished)
        answer = text if self.keep is Keep.API_TEXT else tokenizer(self.model_path).decode(
            list(fin.completion_ids), skip_special_tokens=True)
        self.prompts.append(templated(self.model_path, messages))
        assert len(self.prompts[-1]) == fin.usage.prompt_tokens
        self.history = messages + [{"role": "assistant", "content": answer}]
        self.turns.append((fin.usage.prompt_tokens, fin.completion_ids, text))
        return fin


async def cache_off_outputs(model_path: Path, turns: int, keep: Keep = Keep.DECODED,
                            first_user: str = "") -> list[tuple[int, ...]]:
    conv = Conversation("off", model_path, keep=keep, first_user=first_user)
    async with Engine() as engine:
        await engine.load("m", model_path)
        for _ in range(turns):
            await conv.turn(engine, "m")
    conv.assert_decisive()
    return [ids for _, ids, _ in conv.turns]


def with_template(src: Path, dst: Path, template: str) -> Path:
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(template)
    return dst


@pytest.fixture
def ledger() -> Ledger:
    return Ledger(figures(16 * GiB, env={}), sample=lambda: IDLE)


@pytest.mark.parametrize("tier", [Tier.RAM, Tier.SSD])
async def test_each_turn_reuses_the_whole_previous_turn(tiny_model_path: Path, tmp_path: Path, ledger: Ledger,
                                                        tier: Tier) -> None:
    expected = await cache_off_outputs(tiny_model_path, len(USER_TURNS))
    ssd = SsdStore(tmp_path / "kv", budget=DiskBudget(tmp_path, GiB))
    manager = KvCacheManager(ledger, ssd=ssd)
    conv = Conversation("on", tiny_model_path)
    async with Engine(prefix_cache=manager.get) as engine:
        await engine.load("m", tiny_model_path)
        manager.attach("m", "weights")
        for n in range(len(USER_TURNS)):
            # Only the SSD tier can serve this turn. Turn 2 comes from RAM: the first turn, which
            # nothing had built on yet, was never copied off the device.
            if tier is Tier.SSD and n >= 2:
                manager.get("m").ram.evict_all()
            before = manager.stats()
            fin = await conv.turn(engine, "m")
            after = manager.stats()
            if n == 0:
                continue
            prev_prompt, prev_answer, _ = conv.turns[n - 1]
            assert conv.prompts[n][: prev_prompt + len(prev_answer)] == conv.sequence(n - 1)
            # The previous turn's prompt and answer were all reused (the last prompt token is always fed).
            reused = after.reused_tokens - before.reused_tokens
            assert prev_prompt + len(prev_answer) <= reused < fin.usage.prompt_tokens
            assert (after.ssd_hits - before.ssd_hits) == (1 if tier is Tier.SSD and n >= 2 else 0)
        # One entry per conversation: each turn's sequence replaced the shorter one it extends. (The
        # idle worker hands the last turn over to the SSD tier before it takes the next command.)
        await engine.kv_cache_bytes("m")
        assert manager.get("m").ram.nbytes == ledger.snapshot().bytes_by_kind[ReservationKind.PREFIX_CACHE]
        assert len(manager.get("m").ram) == 1
        assert ssd.entries("m") == 1
        await engine.unload("m")
        manager.purge("m")
    assert [ids for _, ids, _ in conv.turns] == expected
    assert len(ledger) == 0


@pytest.mark.parametrize("template,keep", [(THINK_TEMPLATE, Keep.DECODED), (SHORTENED_TEMPLATE, Keep.DECODED),
                                           (None, Keep.API_TEXT)], ids=["think-block", "shortened", "trimmed-space"])
async def test_a_re_rendered_turn_reuses_only_up_to_the_first_differing_token(
        tiny_model_path: Path, tmp_path: Path, ledger: Ledger, template: str | None, keep: Keep) -> None:
    model_path = tiny_model_path if template is None else with_template(tiny_model_path, tmp_path / "model", template)
    # Every turn opens with the same words, so the common prefix is past what a request reuses at least
    # (kvcache.manager.REUSE_MIN_TOKENS) whatever the answer.
    first_user = "the long road by the quiet river under seven green hills "
    expected = await cache_off_outputs(model_path, 3, keep, first_user)
    manager = KvCacheManager(ledger)
    conv = Conversation("on", model_path, keep=keep, first_user=first_user)
    async with Engine(prefix_cache=manager.get) as engine:
        await engine.load("m", model_path)
        manager.attach("m", "weights")
        await conv.turn(engine, "m")
        re_rendered = 0
        for n in (1, 2):
            previous = conv.sequence(n - 1)
            differ = common_prefix(previous, templated(model_path, conv.next_messages()))
            before = manager.stats().reused_tokens
            await conv.turn(engine, "m")
            assert differ >= REUSE_MIN_TOKENS
            assert manager.stats().reused_tokens - before == differ  # not one token past the difference
            if differ == len(previous):  # (an answer that had no leading space to drop)
                assert keep is Keep.API_TEXT
                continue
            re_rendered += 1
            prompt_tokens = conv.turns[n - 1][0]
            if template is THINK_TEMPLATE:
                assert differ < prompt_tokens  # the difference is in the previous prompt's tail
            elif template is SHORTENED_TEMPLATE:
                assert prompt_tokens < differ  # ... in the middle of the previous answer
            else:
                assert differ == prompt_tokens  # ... at the previous answer's first token
        assert re_rendered >= 1
    assert [ids for _, ids, _ in conv.turns] == expected


async def test_sequences_finished_inside_a_left_padded_batch_are_kept_exactly(tiny_model_path: Path,
                                                                              ledger: Ledger) -> None:
    """Conversations of different lengths finish in one batch (mlx-lm left-pads the shorter ones):
    each kept entry holds exactly the KV a fresh prefill of its own tokens gives, and the next
    turns, run one by one, reuse all of it with outputs identical to the cache off."""
    convs = [Conversation(f"c{i}", tiny_model_path, first_user=" ".join(["words"] * (7 * i))) for i in range(3)]
    off = [Conversation(f"o{i}", tiny_model_path, first_user=" ".join(["words"] * (7 * i))) for i in range(3)]
    async with Engine() as engine:
        await engine.load("m", tiny_model_path)
        await asyncio.gather(*(c.turn(engine, "m") for c in off))
        for c in off:
            await c.turn(engine, "m")
    for c in off:
        c.assert_decisive()

    manager = KvCacheManager(ledger)
    async with Engine(prefix_cache=manager.get) as engine:
        await engine.load("m", tiny_model_path)
        manager.attach("m", "weights")
        await asyncio.gather(*(c.turn(engine, "m") for c in convs))
        assert len({p for p, _, _ in (c.turns[0] for c in convs)}) == 3  # really different lengths
        model, _ = mlx_lm.load(str(tiny_model_path))
        ram = manager.get("m").ram
        for c in convs:
            sequence = c.sequence(0)
            hit = ram.fetch(sequence + [0])
            assert hit is not None and hit.matched == len(sequence)
            fresh = make_prompt_cache(model)
            model(mx.array([sequence]), cache=fresh)
            for kept, ref in zip(hit.cache, fresh):
                assert kept.keys.shape == (1, ref.keys.shape[1], len(sequence), ref.keys.shape[3])
                assert mx.allclose(kept.keys, ref.keys[..., : len(sequence), :], atol=1e-4).item()
                assert mx.allclose(kept.values, ref.values[..., : len(sequence), :], atol=1e-4).item()
        for c in convs:
            before = manager.stats().reused_tokens
            await c.turn(engine, "m")
            prompt_tokens, answer, _ = c.turns[0]
            assert manager.stats().reused_tokens - before >= prompt_tokens + len(answer)
    assert [c.turns for c in convs] == [o.turns for o in off]


async def test_a_live_conversation_is_written_to_ssd_when_it_goes_quiet(tiny_model_path: Path, tmp_path: Path,
                                                                       ledger: Ledger) -> None:
    """Through the engine: turn 1 stays in RAM (nothing has built on it yet), turns 2 and 3 wait (each
    would rewrite the whole conversation), and once the delay has passed the idle worker writes the
    last one."""
    now = [0.0]
    ssd = SsdStore(tmp_path / "kv", budget=DiskBudget(tmp_path, GiB))
    manager = KvCacheManager(ledger, ssd=ssd, write_delay_s=60.0, clock=lambda: now[0])
    conv = Conversation("on", tiny_model_path)
    async with Engine(prefix_cache=manager.get) as engine:
        await engine.load("m", tiny_model_path)
        manager.attach("m", "weights")
        for _ in range(3):
            await conv.turn(engine, "m")
        last = conv.sequence(2)
        assert ssd.entries("m") == 0  # nothing written so far
        now[0] = 61.0
        for _ in range(2):  # the first command wakes the idle worker, the second comes after its writes
            await engine.kv_cache_bytes("m")
        assert ssd.entries("m") == 1 and ssd.longest_match("m", last + [5]) == len(last)
        await engine.unload("m")
        manager.purge("m")


# -- next turn: the answer as the template renders it back, prefilled while the engine is idle ------

def rendered_back(model_path: Path, conv: Conversation) -> list[int]:
    """The finished conversation with its last answer, as the template renders it back."""
    return list(tokenizer(model_path).apply_chat_template(conv.history, add_generation_prompt=False))


class PreparedConversation(Conversation):
    async def turn(self, engine: Engine, model_id: str) -> Finished:
        messages = self.next_messages()
        request = ChatRequest(f"{self.name}-{len(self.turns)}", messages, PARAMS, prepare_next_turn=True)
        text, fin = await engine.submit(model_id, request).collect()
        assert isinstance(fin, Finished)
        answer = text if self.keep is Keep.API_TEXT else tokenizer(self.model_path).decode(
            list(fin.completion_ids), skip_special_tokens=True)
        self.prompts.append(templated(self.model_path, messages))
        self.history = messages + [{"role": "assistant", "content": answer}]
        self.turns.append((fin.usage.prompt_tokens, fin.completion_ids, text))
        return fin


@pytest.mark.parametrize("template", [THINK_TEMPLATE, SHORTENED_TEMPLATE, None],
                         ids=["think-block", "shortened", "trimmed-space"])
async def test_the_next_turn_is_prepared_while_idle_and_reuses_the_re_rendered_answer(
        tiny_model_path: Path, tmp_path: Path, ledger: Ledger, template: str | None) -> None:
    # The client sends back the text it was sent (as an OpenAI client does): the preparation renders that.
    keep = Keep.API_TEXT
    model_path = tiny_model_path if template is None else with_template(tiny_model_path, tmp_path / "model", template)
    expected = await cache_off_outputs(model_path, 3, keep)
    manager = KvCacheManager(ledger)
    conv = PreparedConversation("on", model_path, keep=keep)
    trace = NextTurnTrace()
    async with Engine(prefix_cache=manager.get, trace=trace, next_turn_scratch_bytes=GiB) as engine:
        await engine.load("m", model_path)
        manager.attach("m", "weights")
        await conv.turn(engine, "m")
        beyond_the_generated = 0
        for _ in (1, 2):
            assert await asyncio.wait_for(trace.stored.get(), 60) == "stored"
            prepared = rendered_back(model_path, conv)
            hit = manager.get("m").ram.fetch(prepared + [0])
            assert hit is not None and hit.matched == len(prepared)  # kept under exactly those tokens
            # ... and its KV is what a fresh prefill of them gives.
            model, _ = mlx_lm.load(str(model_path))
            fresh = make_prompt_cache(model)
            model(mx.array([prepared]), cache=fresh)
            for kept, ref in zip(hit.cache, fresh):
                assert mx.allclose(kept.keys, ref.keys[..., : len(prepared), :], atol=1e-4).item()
                assert mx.allclose(kept.values, ref.values[..., : len(prepared), :], atol=1e-4).item()
            previous = conv.sequence(len(conv.turns) - 1)
            if common_prefix(previous, prepared) < len(prepared) - 1:
                beyond_the_generated += 1  # the generated sequence alone would have stopped earlier
            before = manager.stats()
            await conv.turn(engine, "m")
            after = manager.stats()
            assert conv.prompts[-1][: len(prepared)] == prepared
            assert after.reused_tokens - before.reused_tokens == len(prepared)  # only the new message prefilled
            assert after.hits + after.partial_hits - before.hits - before.partial_hits == 1  # the preparation's own lookup is not counted
        assert beyond_the_generated >= 1
        await engine.unload("m")
        manager.purge("m")
    assert [ids for _, ids, _ in conv.turns] == expected
    assert len(ledger) == 0


async def test_a_new_request_drops_the_preparation_and_nothing_half_made_is_kept(
        tiny_model_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    from provider.engine import next_turn

    monkeypatch.setattr(next_turn, "NEXT_TURN_CHUNK", 4)  # several steps for the tiny model's short answers
    model_path = tiny_model_path
    manager = KvCacheManager(ledger)
    conv = PreparedConversation("on", model_path, keep=Keep.API_TEXT)
    trace = NextTurnTrace()
    reached, release = threading.Event(), threading.Event()
    trace.hold = (reached, release)
    async with Engine(prefix_cache=manager.get, trace=trace, next_turn_scratch_bytes=GiB) as engine:
        await engine.load("m", model_path)
        manager.attach("m", "weights")
        await conv.turn(engine, "m")
        assert await asyncio.to_thread(reached.wait, 30)  # the worker is inside a preparation step
        other = engine.submit("m", ChatRequest("other", [{"role": "user", "content": "seven apples"}], PARAMS))
        release.set()
        text, fin = await other.collect()
        assert isinstance(fin, Finished)
        prepared = rendered_back(model_path, conv)
        assert len(prepared) - common_prefix(conv.sequence(0), prepared) > 4  # it needed more than one step
        hit = manager.get("m").ram.fetch(prepared + [0])
        assert hit is None or hit.matched < len(prepared)  # dropped, not stored half-made
        assert trace.steps == 1 and trace.stored.empty()
        await engine.unload("m")
        manager.purge("m")
    assert len(ledger) == 0


async def test_no_preparation_without_room_or_for_requests_not_marked(tiny_model_path: Path, ledger: Ledger) -> None:
    for scratch, marked in ((1, True), (GiB, False)):
        manager = KvCacheManager(ledger)
        trace = NextTurnTrace()
        conv = (PreparedConversation if marked else Conversation)("on", tiny_model_path, keep=Keep.API_TEXT)
        async with Engine(prefix_cache=manager.get, trace=trace, next_turn_scratch_bytes=scratch) as engine:
            await engine.load("m", tiny_model_path)
            manager.attach("m", "weights")
            await conv.turn(engine, "m")
            await conv.turn(engine, "m")  # the engine went idle in between
            await engine.unload("m")
        manager.purge("m")
        assert trace.steps == 0 and trace.stored.empty()


async def test_a_next_turn_sent_within_the_quiet_period_never_meets_a_preparation(
        tiny_model_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    # A client that replies at once (an agent loop, a benchmark) must not wait behind a guess.
    from provider.engine import next_turn

    monkeypatch.setattr(next_turn, "NEXT_TURN_QUIET_S", 3600.0)  # the quiet period never ends in this test
    manager = KvCacheManager(ledger)
    trace = NextTurnTrace()
    conv = PreparedConversation("on", tiny_model_path, keep=Keep.API_TEXT)
    async with Engine(prefix_cache=manager.get, trace=trace, next_turn_scratch_bytes=GiB) as engine:
        await engine.load("m", tiny_model_path)
        manager.attach("m", "weights")
        for _ in range(3):
            await conv.turn(engine, "m")
        await engine.unload("m")
    manager.purge("m")
    assert trace.steps == 0 and trace.stored.empty()
    assert len(ledger) == 0
