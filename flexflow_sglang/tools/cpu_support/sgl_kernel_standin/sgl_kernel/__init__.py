"""CPU stand-in for the CUDA-only ``sgl_kernel`` package (used only when no CUDA GPU is present).

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 does ``from sgl_kernel import ...`` at module level
for exactly these eight names (no submodules are needed on the CPU path):

* ``assign_req_to_token_pool_cpu`` (``srt/mem_cache/allocation.py``), called on every decode step:
  implemented here in plain torch;
* ``copy_all_layer_kv_cache_cpu``, ``build_tree_kernel_efficient_cpu``, ``verify_tree_greedy_cpu``,
  ``assign_draft_cache_locs_contiguous_cpu``, ``assign_extend_cache_locs_cpu``,
  ``fill_accept_out_cache_loc_cpu``, ``fill_bonus_tokens_cpu`` (speculative decoding and KV
  moves): raise ``NotImplementedError``.

Deliberately registers **no** ``torch.ops.sgl_kernel`` op: on an AMX CPU SGLang switches every
layer to its Intel AMX kernels when ``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")``.

Put the parent directory (``.../cpu_support/sgl_kernel_standin``) on ``PYTHONPATH``; see
``flexflow_sglang.tools.cpu_support.cpu_server_env``.
"""

import torch

__all__ = [
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
]

IS_STANDIN = True


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """For each request ``i``: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` = the next
    ``end[i] - start[i]`` entries of ``out_cache_loc`` (the requests' slots are packed back to
    back in batch order), in place. Same semantics as SGLang's Triton kernel
    ``assign_req_to_token_pool``; ``pool_len`` (the row length of ``req_to_token``) is accepted for
    signature compatibility and used only for a bounds check.
    """
    n = int(req_pool_indices.numel())
    if n == 0:
        return
    starts = start_offset.reshape(-1)[:n].to(torch.int64)
    ends = end_offset.reshape(-1)[:n].to(torch.int64)
    lengths = ends - starts
    if n == 1:  # the common decode case for a single running request: no index arithmetic
        s, e = int(starts[0]), int(ends[0])
        if e > s:
            _check_bounds(e, pool_len)
            req_to_token[int(req_pool_indices.reshape(-1)[0]), s:e] = out_cache_loc[: e - s].to(
                req_to_token.dtype
            )
        return
    # Source offset of request i = sum of the lengths of the requests before it (as the Triton
    # kernel computes it); requests with end <= start write nothing.
    src_start = torch.cumsum(lengths, 0) - lengths
    count = lengths.clamp(min=0)
    total = int(count.sum())
    if total == 0:
        return
    _check_bounds(int(ends[count > 0].max()), pool_len)
    rows = torch.repeat_interleave(req_pool_indices.reshape(-1)[:n].to(torch.int64), count)
    first = torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    within = torch.arange(total, dtype=torch.int64, device=req_to_token.device) - first
    cols = torch.repeat_interleave(starts, count) + within
    src = torch.repeat_interleave(src_start, count) + within
    req_to_token[rows, cols] = out_cache_loc[src].to(req_to_token.dtype)


def _check_bounds(end, pool_len):
    if pool_len is not None and end > int(pool_len):
        raise IndexError(f"assign_req_to_token_pool_cpu: end offset {end} > pool_len {pool_len}")


def _missing(name):
    def _not_implemented(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented in the flexflow_sglang CPU stand-in "
            "(speculative decoding and KV-cache moves are unavailable on CPU)"
        )

    _not_implemented.__name__ = name
    _not_implemented.__qualname__ = name
    return _not_implemented


copy_all_layer_kv_cache_cpu = _missing("copy_all_layer_kv_cache_cpu")
build_tree_kernel_efficient_cpu = _missing("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _missing("verify_tree_greedy_cpu")
assign_draft_cache_locs_contiguous_cpu = _missing("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _missing("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _missing("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _missing("fill_bonus_tokens_cpu")
