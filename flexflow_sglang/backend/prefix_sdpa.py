"""`--attention-backend flexflow_sdpa`: SGLang's CPU attention (torch SDPA) without recomputing the
cached prefix's queries.

Why it exists: SGLang's CPU backends (`torch_native`, `flex_attention`) run every extend as if the
whole sequence were new: they build a query as long as the sequence (`per_req_query_redudant`),
compute causal attention for all of it, and keep only the new rows. A prefix hit then saves the
projections and MLP of the cached tokens but none of the attention, which is O(L^2) and dominates a
long prompt. GPU backends (FlashInfer, FA3, Triton) compute only the new tokens' queries against the
whole KV. Measured on the kv128k preset's shapes (float32, 8 heads x 128, one thread;
`python benchmarks/prefix_sdpa.py`): one layer's attention for a 2,048-token prefix plus 32 new tokens
is 139 ms through torch_native and 5.8 ms here (0.04x; 0.18x at a 256-token prefix).
Without this, a CPU benchmark cannot show what a KV cache saves on the hardware it is built for.

What it computes: for a request with P cached tokens and S new ones, SDPA of the S new queries
against all P + S keys with the causal mask shifted by P (key j is visible to new token i iff
j <= P + i). A request with no cached prefix takes the torch_native path unchanged (is_causal on
the same query), so a miss is bit-identical to torch_native. Cross-attention, encoder-decoder
batches and sliding windows also take torch_native's path.

Decode, and an extend whose suffix after a cached prefix is short (at most EXTEND_KERNEL_MAX_ROWS
query rows), read the paged KV in place (csrc/flexflow_sglang/_paged_attention.pyx), as GPU
backends' paged kernels do: torch_native gathers every request's keys and values into new tensors on every
layer of every step (`k_cache[tokens]`) and runs SDPA over the copies: on the kv128k preset a
2-request x 1,300-token step's attention took 144.7 ms that way and 27.8 ms in place (2 threads;
`python benchmarks/paged_decode.py` at 1737bed, docs/results-data-plane.md). The kernel
reads each key and value row once, in float32 (bfloat16 widened on load), and its bytes do not
depend on the thread count. It differs from torch_native's SDPA in the last bits (both are float32
softmax attention; tests/backend/test_prefix_sdpa.py bounds the difference); float16 KV, head dims
not a multiple of 32, sliding windows, cross-attention and an uncompiled build take torch_native's
decode and the gather-then-SDPA extend.

Determinism, measured (`python benchmarks/prefix_sdpa.py --shapes 300`, random prefixes 1-512 and
suffixes 1-64): the new rows differ from torch_native's full recompute in the last bits in 5 of 300
shapes in bfloat16 and 53 of 300 in float32 (oneDNN/MKL block a GEMM by its row count), with no
pattern in the suffix length. So under this backend a prefix hit is not bit-identical to a miss of
the same prompt - as with SGLang's GPU backends, and as SGLang's own linear layers already are on a
hit (they run with M = new tokens). What stays exact: a miss is torch_native's call, and a host hit
computes what a device hit of the same cached length computes (same call on the same KV), which is
what verify_outputs judges (tests/server/test_real_model_server.py, case page1-flexflow-sdpa).

Registered by the plugin (`backend/plugin.py`) in every SGLang process, so a plain server (no
flexflow radix cache) can use it too: benchmarks compare like with like.
"""

from __future__ import annotations

from typing import Optional

BACKEND_NAME = "flexflow_sdpa"

# An extend of at most this many query rows (new tokens x query heads per kv head) after a cached
# prefix runs in the compiled kernel; a longer one through SDPA, whose GEMMs win there
# (float32, 8 x 128 heads, 2 threads, `python benchmarks/paged_extend.py`: docs/results-data-plane.md). The
# choice depends only on the request's own shape, so a host hit and a device hit of the same
# prefix take the same path.
EXTEND_KERNEL_MAX_ROWS = 128

_registered = False


def register_attention_backend() -> None:
    """Make `--attention-backend flexflow_sdpa` a valid choice and build it on demand. Idempotent;
    SGLang is imported here, not at module import (the plugin runs in every process)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend as reg

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    reg(BACKEND_NAME)(_create)
    _registered = True


def _create(model_runner):
    return prefix_sdpa_backend_class()(model_runner)


_cls = None


def prefix_sdpa_backend_class():
    """The backend class, built on first use (it subclasses SGLang's TorchNativeAttnBackend)."""
    global _cls
    if _cls is not None:
        return _cls
    import torch
    from torch.nn.functional import scaled_dot_product_attention
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class PrefixSDPAAttnBackend(TorchNativeAttnBackend):
        """TorchNativeAttnBackend whose extend computes only the new tokens' queries and whose
        decode reads the paged KV in place."""

        def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token,
                                     req_pool_indices, seq_lens, encoder_lens: Optional[torch.Tensor] = None,
                                     scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                                     sliding_window_size: Optional[int] = None):
            windowed = sliding_window_size is not None and sliding_window_size > -1
            if (encoder_lens is not None or is_cross_attn or windowed
                    or not paged_decode_applies(query, k_cache, v_cache)):
                return super()._run_sdpa_forward_decode(
                    query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                    is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
            return paged_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                seq_lens, scaling)

        def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token,
                                     req_pool_indices, seq_lens, extend_prefix_lens,
                                     extend_seq_lens, encoder_lens: Optional[torch.Tensor] = None,
                                     scaling=None, enable_gqa=False, causal=False,
                                     is_cross_attn=False, sliding_window_size=None):
            windowed = sliding_window_size is not None and sliding_window_size > -1
            if encoder_lens is not None or is_cross_attn or not causal or windowed:
                return super()._run_sdpa_forward_extend(
                    query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling,
                    enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
                    sliding_window_size=sliding_window_size)
            # one host sync for the lengths instead of three per request
            prefix_lens = extend_prefix_lens.tolist()
            new_lens = extend_seq_lens.tolist()
            kv_lens = seq_lens.tolist()
            # a hit with a short suffix: the compiled kernel reads the paged KV in place
            in_place = []
            if paged_decode_applies(query, k_cache, v_cache):
                group = query.shape[1] // k_cache.shape[1]
                start_q = 0
                for i, (prefix, new) in enumerate(zip(prefix_lens, new_lens)):
                    if prefix > 0 and 0 < new * group <= EXTEND_KERNEL_MAX_ROWS:
                        in_place.append((i, start_q, new))
                    start_q += new
                paged_extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                             seq_lens, in_place, scaling)
            done = {i for i, _, _ in in_place}
            # [tokens, heads, dim] -> [heads, tokens, dim], as torch_native does
            query = query.movedim(0, query.dim() - 2)
            start_q = 0
            for i, (prefix, new, kv_len) in enumerate(zip(prefix_lens, new_lens, kv_lens)):
                end_q = start_q + new
                if i in done:
                    start_q = end_q
                    continue
                q = query[:, start_q:end_q, :]
                tokens = req_to_token[req_pool_indices[i], :kv_len]
                k = k_cache[tokens].movedim(0, query.dim() - 2)
                v = v_cache[tokens].movedim(0, query.dim() - 2)
                if not (q.dtype == k.dtype == v.dtype):
                    k, v = k.to(q.dtype), v.to(q.dtype)
                if prefix == 0:
                    # a miss: exactly torch_native's call (a contiguous copy of the same query,
                    # is_causal), so its output is bit-identical
                    out = scaled_dot_product_attention(
                        q.contiguous().unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), enable_gqa=enable_gqa,
                        scale=scaling, is_causal=True)
                else:
                    # SDPA's is_causal aligns the diagonal top-left; new token i sits at P + i
                    visible = (torch.arange(kv_len, device=q.device).unsqueeze(0)
                               <= torch.arange(prefix, prefix + new, device=q.device).unsqueeze(1))
                    out = scaled_dot_product_attention(
                        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=visible,
                        enable_gqa=enable_gqa, scale=scaling)
                output[start_q:end_q, :, :] = out.squeeze(0).movedim(query.dim() - 2, 0)
                start_q = end_q
            return output

    _cls = PrefixSDPAAttnBackend
    return _cls


def paged_decode_applies(query, k_cache, v_cache) -> bool:
    """The compiled paged decode handles these shapes and dtypes (else torch_native's decode)."""
    import torch
    if _pa is None or query.device.type != "cpu" or k_cache.device.type != "cpu":
        return False
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (torch.float32, torch.bfloat16):
        return False
    if k_cache.dim() != 3 or v_cache.dim() != 3 or query.dim() != 3:
        return False
    d = query.shape[-1]
    return (k_cache.shape[-1] == d and v_cache.shape[-1] == d and d % 32 == 0
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
            and k_cache.shape[1] == v_cache.shape[1] and query.shape[1] % k_cache.shape[1] == 0)


def paged_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scaling):
    """One query token per request ([batch, q heads, dim]) against its slots' keys and values, read
    in place from one layer's buffers; written into `output` ([batch, q heads, dim])."""
    import torch
    batch, q_heads, dim = query.shape
    lens = seq_lens.tolist()
    rows = req_pool_indices.tolist()
    if len(lens) != batch:
        raise ValueError(f"paged decode: {batch} query tokens for {len(lens)} requests")
    if batch == 0:  # an idle batch (DP attention pads ranks with them): nothing to attend
        return output
    slots = torch.cat([req_to_token[r, :n] for r, n in zip(rows, lens)]).to(torch.int32).contiguous()
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= min(k_cache.shape[0], v_cache.shape[0])):
        raise IndexError(f"paged decode: a KV slot lies outside the pool of {k_cache.shape[0]} tokens")
    starts = torch.zeros(batch + 1, dtype=torch.int64)
    starts[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    q = query.to(torch.float32).contiguous()
    direct = output.dtype == torch.float32 and output.is_contiguous()
    out = output if direct else torch.empty((batch, q_heads, dim), dtype=torch.float32)
    _pa.decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), slots.numpy(),
               starts.numpy(), batch, q_heads, k_cache.shape[1], dim, k_cache.stride(0), k_cache.stride(1),
               v_cache.stride(0), v_cache.stride(1), float(dim ** -0.5 if scaling is None else scaling),
               k_cache.dtype == torch.bfloat16, torch.get_num_threads())
    if not direct:
        output.copy_(out)
    return output


def paged_extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                 requests, scaling):
    """Extend attention for `requests` (a list of (batch index, first query row, new tokens)) whose
    new tokens follow a cached prefix: their rows of `query` ([tokens, q heads, dim]) against their
    slots' keys and values read in place, written into the same rows of `output`. Other rows of
    `output` are left as they are."""
    import torch
    if not requests:
        return output
    lens = seq_lens.tolist()
    rows = req_pool_indices.tolist()
    slots = torch.cat([req_to_token[rows[i], :lens[i]] for i, _, _ in requests]).to(torch.int32).contiguous()
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= min(k_cache.shape[0], v_cache.shape[0])):
        raise IndexError(f"paged extend: a KV slot lies outside the pool of {k_cache.shape[0]} tokens")
    starts = torch.zeros(len(requests) + 1, dtype=torch.int64)
    starts[1:] = torch.tensor([lens[i] for i, _, _ in requests], dtype=torch.int64).cumsum(0)
    q_offsets = torch.tensor([q0 for _, q0, _ in requests], dtype=torch.int64)
    new_lens = torch.tensor([new for _, _, new in requests], dtype=torch.int64)
    _, q_heads, dim = query.shape
    q = query.to(torch.float32).contiguous()
    direct = output.dtype == torch.float32 and output.is_contiguous()
    out = output if direct else torch.empty(q.shape, dtype=torch.float32)
    _pa.extend(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), slots.numpy(),
               starts.numpy(), q_offsets.numpy(), new_lens.numpy(), len(requests), q_heads, k_cache.shape[1],
               dim, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
               float(dim ** -0.5 if scaling is None else scaling), k_cache.dtype == torch.bfloat16,
               torch.get_num_threads())
    if not direct:
        for _, q0, new in requests:
            output[q0:q0 + new].copy_(out[q0:q0 + new])
    return output


try:
    from .. import _paged_attention as _pa
except ImportError:  # an uncompiled build: torch_native's decode
    _pa = None
