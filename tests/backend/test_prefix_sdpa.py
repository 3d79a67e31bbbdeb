"""flexflow_sdpa: the new tokens' attention computed against the whole KV, equal to SGLang's
torch_native (which recomputes every cached position's query) on the rows that are kept."""

import pytest
import torch

from flexflow_sglang.backend.prefix_sdpa import BACKEND_NAME, prefix_sdpa_backend_class, register_attention_backend

torch_native_backend = pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")


def _bare(cls):
    # _run_sdpa_forward_extend reads no state set by __init__ (which wants a ModelRunner)
    return object.__new__(cls)


def _batch(dtype, prefix_lens, new_lens, heads=4, kv_heads=2, dim=32, seed=0):
    """A KV pool with each request's tokens scattered in it, and the new tokens' queries."""
    g = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    pool = sum(kv_lens) + 16
    k_cache = torch.randn(pool, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(pool, kv_heads, dim, generator=g).to(dtype)
    slots = torch.randperm(pool, generator=g)[:sum(kv_lens)]
    req_to_token = torch.zeros(len(kv_lens) + 1, max(kv_lens), dtype=torch.int64)
    at = 0
    for r, n in enumerate(kv_lens):
        req_to_token[r + 1, :n] = slots[at:at + n]   # row 0 unused: pool indices are not positions
        at += n
    query = torch.randn(sum(new_lens), heads, dim, generator=g).to(dtype)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token,
                req_pool_indices=t(range(1, len(kv_lens) + 1)), seq_lens=t(kv_lens),
                extend_prefix_lens=t(prefix_lens), extend_seq_lens=t(new_lens))


def _run(backend, b, **kw):
    out = torch.empty_like(b["query"])
    backend._run_sdpa_forward_extend(b["query"], out, b["k_cache"], b["v_cache"], b["req_to_token"],
                                     b["req_pool_indices"], b["seq_lens"], b["extend_prefix_lens"],
                                     b["extend_seq_lens"], None, scaling=0.125, enable_gqa=True,
                                     causal=True, **kw)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_new_rows_match_torch_native_for_a_mixed_batch(dtype):
    # a miss, a long prefix with a few new tokens, a short prefix with many, one new token
    b = _batch(dtype, prefix_lens=[0, 300, 7, 129], new_lens=[40, 17, 64, 1])
    ours = _run(_bare(prefix_sdpa_backend_class()), b)
    native = _run(_bare(torch_native_backend.TorchNativeAttnBackend), b)
    # the miss takes torch_native's exact call
    assert torch.equal(ours[:40], native[:40])
    # the hits' rows: equal up to rounding (the short suffixes run in the compiled kernel in float32,
    # rounded once to the output dtype; torch_native's SDPA runs in the KV's dtype; either way GEMMs
    # block by row count: backend/prefix_sdpa.py, measured by benchmarks/prefix_sdpa.py)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(ours, native, atol=tol, rtol=tol)
    # ... and the same call on the same KV gives the same bits: a host hit equals a device hit
    assert torch.equal(ours, _run(_bare(prefix_sdpa_backend_class()), b))


def test_the_shifted_causal_mask_hides_later_tokens():
    # changing a key after new token i's position must not change row i; a key before it must
    b = _batch(torch.float32, prefix_lens=[50], new_lens=[10])
    backend = _bare(prefix_sdpa_backend_class())
    before = _run(backend, b)
    slot_of = b["req_to_token"][1]
    b["k_cache"][slot_of[55]] += 3.0           # position 55 = new token 5
    b["v_cache"][slot_of[55]] -= 2.0
    after = _run(backend, b)
    assert torch.equal(before[:5], after[:5])   # tokens 50..54 cannot see position 55
    assert not torch.allclose(before[5:], after[5:])


def test_sliding_window_takes_torch_natives_path():
    b = _batch(torch.bfloat16, prefix_lens=[40], new_lens=[8])
    ours = _run(_bare(prefix_sdpa_backend_class()), b, sliding_window_size=16)
    native = _run(_bare(torch_native_backend.TorchNativeAttnBackend), b, sliding_window_size=16)
    assert torch.equal(ours, native)


def test_registered_as_a_server_choice():
    register_attention_backend()
    register_attention_backend()            # idempotent: the plugin runs in every process
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    assert ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1
    assert BACKEND_NAME in ATTENTION_BACKENDS
    from sglang.srt.server_args import prepare_server_args
    args = prepare_server_args(["--model-path", "/nonexistent", "--attention-backend", BACKEND_NAME])
    assert args.attention_backend == BACKEND_NAME


# ----------------------------------------------------------------- decode: paged KV read in place
def _decode(backend, b, threads=None):
    """One decode token per request: the last query row of each request's batch entry."""
    q = torch.randn(len(b["seq_lens"]), b["query"].shape[1], b["query"].shape[2],
                    generator=torch.Generator().manual_seed(7)).to(b["query"].dtype)
    out = torch.empty_like(q)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        backend._run_sdpa_forward_decode(q, out, b["k_cache"], b["v_cache"], b["req_to_token"],
                                         b["req_pool_indices"], b["seq_lens"], None, scaling=0.125,
                                         enable_gqa=q.shape[1] != b["k_cache"].shape[1])
    finally:
        torch.set_num_threads(before)
    return out


def _compiled_decode():
    import os
    from flexflow_sglang.backend import prefix_sdpa
    if prefix_sdpa._pa is None:
        if os.environ.get("FLEXFLOW_REQUIRE_COMPILED", "0") not in ("", "0"):
            pytest.fail("FLEXFLOW_REQUIRE_COMPILED=1 but flexflow_sglang._paged_attention is not built")
        pytest.skip("flexflow_sglang._paged_attention not built (pip install -e . with Cython)")


@pytest.mark.parametrize("dtype,heads,kv_heads,dim,tol", [(torch.float32, 8, 8, 128, 1e-5),
                                                        (torch.float32, 4, 2, 32, 1e-5),
                                                        (torch.bfloat16, 6, 2, 64, 1e-2)])
def test_paged_decode_matches_torch_native(dtype, heads, kv_heads, dim, tol):
    _compiled_decode()
    # requests of 1, 9 and 700 tokens, slots scattered over the pool
    b = _batch(dtype, prefix_lens=[0, 8, 699], new_lens=[1, 1, 1], heads=heads, kv_heads=kv_heads, dim=dim)
    ours = _decode(_bare(prefix_sdpa_backend_class()), b)
    native = _decode(_bare(torch_native_backend.TorchNativeAttnBackend), b)
    assert ours.dtype == native.dtype and ours.shape == native.shape
    assert torch.allclose(ours.float(), native.float(), atol=tol, rtol=tol), (ours.float() - native.float()).abs().max()
    # a one-token request attends only to itself: its output is its value row, exactly
    slot = int(b["req_to_token"][1, 0])
    expect = b["v_cache"][slot].float().repeat_interleave(heads // kv_heads, dim=0)
    assert torch.allclose(ours[0].float(), expect, atol=tol, rtol=tol)


def test_paged_decode_bytes_do_not_depend_on_the_thread_count():
    _compiled_decode()
    b = _batch(torch.float32, prefix_lens=[300, 40, 5], new_lens=[1, 1, 1], heads=8, kv_heads=4, dim=64)
    backend = _bare(prefix_sdpa_backend_class())
    assert torch.equal(_decode(backend, b, threads=1), _decode(backend, b, threads=2))


def test_paged_decode_reads_only_each_requests_own_slots():
    _compiled_decode()
    b = _batch(torch.float32, prefix_lens=[30, 30], new_lens=[1, 1])
    backend = _bare(prefix_sdpa_backend_class())
    before = _decode(backend, b)
    b["k_cache"][b["req_to_token"][2, 10]] += 5.0     # a key of request 1 only
    after = _decode(backend, b)
    assert torch.equal(before[0], after[0])
    assert not torch.allclose(before[1], after[1])


def test_paged_decode_refuses_a_slot_outside_the_pool():
    _compiled_decode()
    b = _batch(torch.float32, prefix_lens=[10], new_lens=[1])
    b["req_to_token"][1, 3] = b["k_cache"].shape[0] + 5
    with pytest.raises(IndexError, match="outside the pool"):
        _decode(_bare(prefix_sdpa_backend_class()), b)


def test_float16_decode_takes_torch_natives_path():
    b = _batch(torch.float16, prefix_lens=[20, 3], new_lens=[1, 1])
    ours = _decode(_bare(prefix_sdpa_backend_class()), b)
    native = _decode(_bare(torch_native_backend.TorchNativeAttnBackend), b)
    assert torch.equal(ours, native)


def test_paged_decode_of_an_empty_batch_is_a_no_op():
    _compiled_decode()
    from flexflow_sglang.backend.prefix_sdpa import paged_decode
    k = torch.randn(16, 2, 32)
    out = torch.empty(0, 4, 32)
    assert paged_decode(torch.empty(0, 4, 32), out, k, k.clone(), torch.zeros(2, 8, dtype=torch.int32),
                        torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), None) is out


def _extend_threads(backend, b, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(backend, b)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype,heads,kv_heads,dim,tol", [(torch.float32, 8, 8, 128, 1e-5),
                                                        (torch.float32, 4, 1, 64, 1e-5),
                                                        (torch.bfloat16, 6, 2, 96, 1e-2)])
def test_paged_extend_matches_torch_native(dtype, heads, kv_heads, dim, tol, monkeypatch):
    _compiled_decode()
    from flexflow_sglang.backend import prefix_sdpa
    from flexflow_sglang.backend.prefix_sdpa import EXTEND_KERNEL_MAX_ROWS
    taken = []
    real = prefix_sdpa.paged_extend
    monkeypatch.setattr(prefix_sdpa, "paged_extend", lambda *a: (taken.extend(i for i, _, _ in a[7]), real(*a))[1])
    group = heads // kv_heads
    # suffixes of 1 token, of an odd count, of more than one block (64 rows), and of the most rows
    # the kernel takes; a miss and a suffix too long for the kernel ride in the same batch
    longest = EXTEND_KERNEL_MAX_ROWS // group
    b = _batch(dtype, prefix_lens=[700, 33, 1, 0, 90, 5], new_lens=[1, 13, 70 // group, 9, longest, longest + 1],
               heads=heads, kv_heads=kv_heads, dim=dim)
    ours = _run(_bare(prefix_sdpa_backend_class()), b)
    native = _run(_bare(torch_native_backend.TorchNativeAttnBackend), b)
    torch.testing.assert_close(ours.float(), native.float(), atol=tol, rtol=tol)
    assert taken == [0, 1, 2, 4]     # not the miss, not the suffix over the kernel's rows


def test_paged_extend_bytes_do_not_depend_on_the_thread_count():
    _compiled_decode()
    b = _batch(torch.float32, prefix_lens=[300, 40, 5], new_lens=[30, 7, 16], heads=8, kv_heads=4, dim=64)
    backend = _bare(prefix_sdpa_backend_class())
    assert torch.equal(_extend_threads(backend, b, 1), _extend_threads(backend, b, 2))


def test_paged_extend_hides_later_tokens_and_other_requests():
    _compiled_decode()
    b = _batch(torch.float32, prefix_lens=[50, 50], new_lens=[6, 6])
    backend = _bare(prefix_sdpa_backend_class())
    before = _run(backend, b)
    # request 0's last new token's key and value change: its earlier new tokens must not see it,
    # nor may request 1
    slot = b["req_to_token"][1, 55]
    b["k_cache"][slot] += 5.0
    b["v_cache"][slot] -= 3.0
    after = _run(backend, b)
    assert torch.equal(before[:5], after[:5])
    assert not torch.allclose(before[5], after[5])
    assert torch.equal(before[6:], after[6:])


def test_paged_extend_refuses_a_slot_outside_the_pool():
    _compiled_decode()
    b = _batch(torch.float32, prefix_lens=[10], new_lens=[3])
    b["req_to_token"][1, 3] = b["k_cache"].shape[0] + 5
    with pytest.raises(IndexError, match="outside the pool"):
        _run(_bare(prefix_sdpa_backend_class()), b)


def test_head_dims_the_kernel_does_not_tile_take_torch_natives_path():
    # 80 is not a multiple of the kernel's 32-lane passes: SDPA on gathered copies, exactly as before
    b = _batch(torch.float32, prefix_lens=[20, 3], new_lens=[4, 1], dim=80)
    from flexflow_sglang.backend.prefix_sdpa import paged_decode_applies
    assert not paged_decode_applies(b["query"], b["k_cache"], b["v_cache"])
    ours = _run(_bare(prefix_sdpa_backend_class()), b)
    native = _run(_bare(torch_native_backend.TorchNativeAttnBackend), b)
    torch.testing.assert_close(ours, native)
