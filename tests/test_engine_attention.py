"""The CPU attention (provider/engine/attention.py) against MLX's own, and where the engine uses it.

Its softmax is computed another way (a polynomial `2**t`, normalised after the value matmul), so it
agrees with MLX's to float32 rounding, not bit for bit. Greedy tokens of the random-weight tiny
models can flip on rounding alone (moving the attention scale from the queries to the keys flips the
tiny VLM's second token), so the engine's tokens are compared with mlx-lm's run under the same
attention: the pipeline is checked there, the arithmetic here. Outputs are compared bit for bit only
where one computation runs twice, the same ops on the same shapes (what goes to MLX's unchanged, the
attention on another thread): the BLAS kernel cannot differ there.
"""

from __future__ import annotations

import asyncio
import sys
import threading

import mlx.core as mx
import numpy as np
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_arithmetic import engine_attention
from engine_reference import NO_EOS, PROMPTS, greedy, messages, reference_greedy
from provider.engine import ChatRequest, Engine, attention
from provider.engine.attention import exp2, mlx_attention, scaled_dot_product_attention
from provider.engine.layout import on_cpu

RTOL = 2e-6  # of the output's largest magnitude: float32 rounding through two matmuls and a softmax


def close(ours: mx.array, theirs: mx.array, rtol: float = RTOL) -> bool:
    ours, theirs = ours.astype(mx.float32), theirs.astype(mx.float32)
    return mx.abs(ours - theirs).max().item() <= rtol * max(mx.abs(theirs).max().item(), 1e-30)


def qkv(b: int, heads: int, kv: int, length: int, keys: int, dim: int = 16, seed: int = 0, dtype=mx.float32):
    kq, kk, kvv = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((b, heads, length, dim), key=kq).astype(dtype),
            mx.random.normal((b, kv, keys, dim), key=kk).astype(dtype),
            mx.random.normal((b, kv, keys, dim), key=kvv).astype(dtype))


def left_padded(b: int, length: int, keys: int) -> mx.array:
    """mlx-lm's batch mask: causal, and row i of the batch starts after `i` padding keys."""
    causal = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None]
    starts = mx.arange(b)[:, None, None, None]
    return causal & (mx.arange(keys) >= starts)


# -- exp2 ---------------------------------------------------------------------------------------

def test_exp2_is_within_about_an_ulp_of_the_exact_value():
    t = np.concatenate([np.linspace(-126.0, 0.0, 400_001), [-0.5, -0.5000001, -1.5, -125.9999]]).astype(np.float32)
    exact = np.exp2(t.astype(np.float64))
    got = np.array(exp2(mx.array(t)), dtype=np.float64)
    assert np.max(np.abs(got - exact) / exact) < 1.2e-7  # a float32 ulp is 6e-8 to 1.2e-7 of the value


def test_exp2_is_exact_at_0_and_0_for_a_masked_score():
    got = exp2(mx.array([0.0, -1.0, -127.0, -500.0, -1e30, -np.inf], dtype=mx.float32)).tolist()
    assert got == [1.0, 0.5, 0.0, 0.0, 0.0, 0.0]


# -- compiled for a bounded number of shapes ------------------------------------------------------

def exp2_traces(fn) -> int:
    """How often `fn` ran the Python bodies of exp2's compiled steps: MLX runs them only to trace."""
    steps = {"_reduce", "_poly_high", "_poly_low_scaled"}
    traces = 0

    def profile(frame, event, arg):
        nonlocal traces
        if event == "call" and frame.f_code.co_filename == attention.__file__ and frame.f_code.co_name in steps:
            traces += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return traces


def test_exp2_keeps_the_traces_of_max_shapes_shapes_at_most(monkeypatch):
    """exp2's steps are compiled for each shape; after MAX_SHAPES shapes they are compiled anew, so MLX
    drops the old traces: a shape met again after that is traced again."""
    monkeypatch.setattr(attention, "MAX_SHAPES", 4)
    monkeypatch.setattr(attention, "_compiled", attention._Compiled())
    shapes = [(1, 2, 3, keys) for keys in range(40, 50)]
    first = exp2_traces(lambda: mx.eval(exp2(-mx.ones(shapes[0]))))
    assert first == 3 and exp2_traces(lambda: mx.eval(exp2(-mx.ones(shapes[0])))) == 0  # kept while in use
    for shape in shapes[1:]:
        assert exp2_traces(lambda shape=shape: mx.eval(exp2(-mx.ones(shape)))) == 3
        assert len(attention._compiled.shapes) <= 4
    assert exp2_traces(lambda: mx.eval(exp2(-mx.ones(shapes[0])))) == 3  # its trace was dropped


def test_many_shapes_do_not_grow_the_process():
    """A decode step or a prefill meets a new shape nearly every time: 3,000 of them (~100 MiB of
    MLX's traces if every shape's were kept) leave the process within a few MiB."""
    def run(keys: range) -> None:
        for k in keys:
            mx.eval(exp2(-mx.ones((1, 2, 1, k))))
            mx.clear_cache()  # each size's buffers back to the allocator at once, not kept by MLX

    run(range(1, 1 + 2 * attention.MAX_SHAPES))  # the traces it keeps, and the allocator's warm-up
    before = psutil.Process().memory_info().rss
    run(range(1_000, 4_000))
    assert psutil.Process().memory_info().rss - before < 16 * 2**20


# -- the attention against MLX's ------------------------------------------------------------------

CASES = {
    "prefill after a cached prefix, grouped heads": ((1, 8, 2, 24, 90), "causal"),
    "a whole prompt, causal": ((1, 4, 4, 33, 33), "causal"),
    "decode step, no mask": ((3, 8, 2, 1, 70), None),
    "boolean (L, S) mask": ((1, 4, 1, 5, 40), "bool"),
    "left-padded batch, rows masked whole": ((3, 4, 2, 6, 6), "left"),
    "additive mask": ((2, 6, 3, 7, 20), "additive"),
    "a mask per head": ((2, 4, 2, 3, 11), "per-head"),
}


def mask_for(kind, b, heads, length, keys, seed=1):
    key = mx.random.key(seed)
    match kind:
        case None | "causal":
            return kind
        case "bool":
            return mx.random.bernoulli(0.7, (length, keys), key=key) | (mx.arange(keys) == 0)[None]
        case "left":
            return left_padded(b, length, keys)
        case "additive":
            return mx.random.normal((b, 1, length, keys), key=key) * 3.0
        case "per-head":
            return mx.random.bernoulli(0.6, (b, heads, length, keys), key=key)


@pytest.mark.parametrize("shape, kind", CASES.values(), ids=CASES.keys())
def test_the_attention_is_mlx_s_to_rounding(shape, kind):
    b, heads, kv, length, keys = shape
    q, k, v = qkv(b, heads, kv, length, keys)
    mask = mask_for(kind, b, heads, length, keys)
    assert close(scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask),
                 mlx_attention(q, k, v, scale=0.25, mask=mask))


def test_half_precision_inputs_get_a_float32_softmax():
    q, k, v = qkv(1, 8, 2, 9, 50, dtype=mx.float16)
    ours = scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert ours.dtype == mx.float16
    reference = mlx_attention(*(a.astype(mx.float32) for a in (q, k, v)), scale=0.25, mask="causal")
    assert close(ours, reference, rtol=2e-3)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), kv=st.integers(1, 3), rep=st.integers(1, 3), length=st.integers(1, 12),
       extra=st.integers(0, 40), kind=st.sampled_from([None, "causal", "bool", "left", "additive", "per-head"]),
       scale=st.floats(0.05, 2.0), seed=st.integers(0, 2**16))
def test_any_shape_and_mask_matches_mlx(b, kv, rep, length, extra, kind, scale, seed):
    keys = length + extra if kind != "left" else length
    q, k, v = qkv(b, kv * rep, kv, length, keys, dim=8, seed=seed)
    mask = mask_for(kind, b, kv * rep, length, keys, seed=seed + 1)
    assert close(scaled_dot_product_attention(q, k, v, scale=scale, mask=mask),
                 mlx_attention(q, k, v, scale=scale, mask=mask), rtol=5e-6)


def test_what_it_does_not_handle_goes_to_mlx_unchanged():
    q, k, v = qkv(1, 4, 2, 5, 12)
    sinks = mx.zeros((4,))
    wide = mx.ones((1, 2, 5, 12), dtype=mx.bool_)  # a mask per KV head is not a broadcast of [B, heads, L, S]
    for kwargs in ({"sinks": sinks}, {"mask": wide}):
        try:
            expected = mlx_attention(q, k, v, scale=0.5, **kwargs)
        except ValueError:  # MLX refuses it: so must the call through ours
            with pytest.raises(ValueError):
                scaled_dot_product_attention(q, k, v, scale=0.5, **kwargs)
            continue
        assert mx.array_equal(scaled_dot_product_attention(q, k, v, scale=0.5, **kwargs), expected).item()


# -- per thread ---------------------------------------------------------------------------------

def test_enable_changes_the_calling_thread_only():
    q, k, v = qkv(1, 8, 2, 16, 64, seed=3)
    ours = scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    theirs = mlx_attention(q, k, v, scale=0.25, mask="causal")
    mx.eval(ours, theirs)
    assert not mx.array_equal(ours, theirs).item()  # else this test could not tell them apart

    seen = {}

    def engine_thread():
        attention.enable()
        try:
            seen["enabled"] = attention.enabled()
            seen["out"] = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
            mx.eval(seen["out"])
        finally:
            attention.disable()

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen["enabled"] and mx.array_equal(seen["out"], ours).item()
    assert not attention.enabled()
    assert mx.array_equal(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal"), theirs).item()


# -- in the engine ------------------------------------------------------------------------------

@pytest.mark.parametrize("setting", [None, True, False])
async def test_the_engine_thread_uses_it_on_the_cpu_and_keeps_mlx_lm_greedy_tokens(tiny_model_path, reference,
                                                                                   setting):
    on = on_cpu() if setting is None else setting
    with engine_attention(on):  # the reference under the same arithmetic (module docstring)
        expected = [reference_greedy(reference, p, 16, eos=NO_EOS)[0] for p in PROMPTS]
    async with Engine(cpu_attention=setting) as engine:
        info = await engine.load("tiny", tiny_model_path, eos_token_ids=NO_EOS)
        results = await asyncio.gather(*(
            engine.submit("tiny", ChatRequest(f"r{i}", messages(p), greedy(16))).collect()
            for i, p in enumerate(PROMPTS)))
    assert info.cpu_attention == on
    assert [list(r[1].completion_ids) for r in results] == expected


# -- memory ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [None, "causal", "left", "additive", "per-head"])
def test_queries_in_blocks_give_the_same_attention(monkeypatch, kind):
    b, heads, kv, length, keys = 2, 4, 2, 37, 45
    q, k, v = qkv(b, heads, kv, length, keys, seed=5)
    mask = mask_for(kind, b, heads, length, keys)
    whole = scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    monkeypatch.setattr(attention, "BLOCK_BYTES", b * heads * keys * 4 * 5)  # blocks of 5 rows, the last of 2
    blocked = scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    assert close(blocked, whole, rtol=1e-6)  # the BLAS may block a 5-row matmul its own way: rounding only
    assert close(blocked, mlx_attention(q, k, v, scale=0.3, mask=mask))


def peak_above(fn) -> int:
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(fn())
    return mx.get_peak_memory() - base


@pytest.mark.parametrize("mask", [None, "causal"])
def test_a_long_prompt_s_attention_peaks_below_mlx_s(mask):
    q, k, v = qkv(1, 8, 2, 512, 4096, dim=32, seed=7)  # 64 MiB of float32 scores
    mx.eval(q, k, v)
    scores = 8 * 512 * 4096 * 4
    theirs = peak_above(lambda: mlx_attention(q, k, v, scale=0.2, mask=mask))
    ours = peak_above(lambda: scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask))
    assert theirs >= scores  # MLX's holds the whole [heads, L, S] of scores at once
    assert ours <= 8 * attention.BLOCK_BYTES  # about five blocks, whatever the prompt


def test_blocks_inside_mx_compile_go_to_mlx_s(monkeypatch):
    q, k, v = qkv(1, 4, 2, 12, 30, seed=9)
    monkeypatch.setattr(attention, "BLOCK_BYTES", 4 * 30 * 4 * 3)  # 4 blocks: each would be evaluated early
    compiled = mx.compile(lambda q, k, v: scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal"))
    assert mx.array_equal(compiled(q, k, v), mlx_attention(q, k, v, scale=0.5, mask="causal")).item()


@pytest.mark.parametrize("length", [12, 1])
@pytest.mark.parametrize("bits", [(8, 8, 64), (4, 4, 64), (8, 8, 32), (8, 4, 32)], ids=lambda b: "k{}v{}g{}".format(*b))
@pytest.mark.parametrize("mask", ["causal", "array", None])
def test_attention_over_dequantized_kv_matches_the_quantized_kernels(bits, mask, length):
    """Quantized KV on the CPU: a prompt's rows and a decode step's row attend over the dequantized copy
    (attention.quantized_attention) and get what MLX's quantized kernels give (kvcache.quantized's
    attention, keys and values at their own bits; at one bits, exactly mlx-lm's own), padded rows and
    grouped heads included."""
    from kvcache import quantized as quantized_kv

    key_bits, value_bits, group = bits
    mx.random.seed(3)
    b, heads, kv, keys, d = 2, 8, 2, 40, 64
    q = mx.random.normal((b, heads, length, d))
    k, v = mx.random.normal((b, kv, keys, d)), mx.random.normal((b, kv, keys, d))
    qk, qv = mx.quantize(k, group, key_bits), mx.quantize(v, group, value_bits)
    if mask == "array":  # the batch cache's mask: row 1 left-padded by 5 positions, causal
        positions = mx.arange(keys)[None, None, None, :]
        rows = mx.arange(keys - length, keys)[None, None, :, None]
        mask = (positions <= rows) & (positions >= mx.array([0, 5])[:, None, None, None])
    got = attention.quantized_attention(q, qk, qv, 0.125, mask, group_size=group)
    want = quantized_kv.quantized_attention(q, qk, qv, 0.125, mask, group_size=group)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=2e-4, rtol=2e-4).item()
    if key_bits == value_bits:  # mlx-lm scales its queries in place (`queries *= scale`): it gets a copy
        mlx_lm_s = quantized_kv.mlx_lm_quantized_attention(mx.array(q), qk, qv, scale=0.125, mask=mask,
                                                           group_size=group, bits=key_bits)
        assert mx.array_equal(want, mlx_lm_s).item()


@pytest.mark.parametrize("bound_heads", [0.5, 1, 3, 8])
def test_quantized_kv_too_large_for_one_copy_is_attended_in_blocks_with_the_same_result(monkeypatch, bound_heads):
    """Past `DEQUANTIZED_BYTES` the copy is made a block of batch rows (or of KV heads, where one row is
    too large) at a time; each block's copy fits the bound and the attention is the same."""
    from kvcache.quantized import quantized_attention as quantized_kernels

    mx.random.seed(4)
    b, heads, kv, keys, length, d = 3, 8, 4, 40, 5, 64
    q = mx.random.normal((b, heads, length, d))
    qk = mx.quantize(mx.random.normal((b, kv, keys, d)), 32, 8)
    qv = mx.quantize(mx.random.normal((b, kv, keys, d)), 32, 4)
    positions = mx.arange(keys)[None, None, None, :]
    rows = mx.arange(keys - length, keys)[None, None, :, None]
    mask = (positions <= rows) & (positions >= mx.array([0, 5, 9])[:, None, None, None])
    one_head = attention.dequantized_bytes(q, qk) // (b * kv)
    monkeypatch.setattr(attention, "DEQUANTIZED_BYTES", int(bound_heads * one_head))
    copies: list[tuple[int, int]] = []

    def attend(queries, keys, values, *, scale, mask):
        copies.append(keys.shape[:2])
        return attention.mlx_attention(queries, keys, values, scale=scale, mask=mask)

    got = attention.quantized_attention(q, qk, qv, 0.125, mask, group_size=32, attend=attend)
    want = quantized_kernels(q, qk, qv, 0.125, mask, group_size=32)
    assert mx.allclose(got, want, atol=2e-4, rtol=2e-4).item()
    held = max(1, int(bound_heads))  # KV heads a block may hold
    assert all(r * h <= held for r, h in copies) and sum(r * h for r, h in copies) == b * kv
    blocks = b * -(-kv // held) if held < kv else -(-b // (held // kv))  # whole rows once a row fits
    assert len(copies) == blocks


def test_the_engine_thread_dequantizes_quantized_kv_and_other_threads_keep_the_quantized_kernels(monkeypatch):
    """enable(): this module's float attention over the copy (the CPU); enable_dequantized_kv(): MLX's
    own (a GPU without quantized attention); neither: MLX's quantized kernels (kvcache.quantized's)."""
    from mlx_lm.models import base

    used: list[str] = []
    monkeypatch.setattr(attention, "scaled_dot_product_attention", lambda *a, **k: used.append("ours") or a[0])
    monkeypatch.setattr(attention, "mlx_attention", lambda *a, **k: used.append("mlx") or a[0])
    monkeypatch.setattr(attention, "mlx_quantized_attention", lambda q, *a, **k: used.append("kernels") or q)
    packed = mx.quantize(mx.zeros((1, 1, 64, 64)), 64, 8)
    query = mx.zeros((1, 1, 1, 64))

    def call():
        base.quantized_scaled_dot_product_attention(query, packed, packed, scale=1.0, mask=None, group_size=64)

    try:
        attention.enable()
        call()
        attention.disable()
        attention.enable_dequantized_kv()
        call()
        assert attention.dequantizes() and not attention.enabled()
    finally:
        attention.disable()
    call()
    assert used == ["ours", "mlx", "kernels"]


def test_the_cpu_and_metal_have_quantized_kernels_and_cuda_does_not(monkeypatch):
    assert attention.quantized_kernels()  # this machine: the CPU device
    monkeypatch.setattr(attention.mx, "default_device", lambda: attention.mx.gpu)
    monkeypatch.setattr(attention.mx.metal, "is_available", lambda: False)
    assert not attention.quantized_kernels()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_cpu_dequantize_gives_mlxs_values(bits, dtype):
    mx.random.seed(5)
    x = mx.random.normal((2, 3, 17, 128)).astype(dtype)
    packed = mx.quantize(x, 64, bits)
    want = mx.dequantize(*packed, group_size=64, bits=bits)
    got = attention.dequantize(*packed, group_size=64, bits=bits)
    assert got.dtype == want.dtype and got.shape == want.shape == x.shape
    assert mx.array_equal(got, want).item()
