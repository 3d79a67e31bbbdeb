# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Decode attention read straight from SGLang's paged KV buffers (`--attention-backend flexflow_sdpa`,
backend/prefix_sdpa.py).

Why: SGLang's CPU decode (torch_native) gathers every request's keys and values into new tensors
(`k_cache[tokens]`) on every layer of every step, then runs SDPA over the copies: the KV is read
twice and written once. On the kv128k preset (128 KB of KV per token) a decode step of 2 requests
x 1,300 tokens took 144.7 ms of attention that way, 27.8 ms here (2 threads;
`python benchmarks/paged_decode.py` at 1737bed, docs/results.md). GPU backends
(FlashInfer's paged decode) read the pages in place; so does this kernel: one read of each key row
and each value row, nothing written but the output.

What it computes, per request b and query head h (kv head h / G, G = query heads per kv head):
    s_t = scale * q[b, h] . K[slot_t, h / G]        for the request's slots t = 0 .. n-1
    out[b, h] = sum_t softmax(s)_t V[slot_t, h / G]
in float32 (bfloat16 KV is widened on load), the same as SDPA's math up to rounding. The order of
every sum is fixed by this code and one (request, kv head) pair is one thread's work, so the bytes
do not depend on the thread count: a host hit, a device hit and any TP layout give the same result.
"""

from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport malloc, free
from cython.parallel cimport prange, threadid

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #include <math.h>
    typedef float ff_v8f __attribute__((vector_size(32)));
    typedef uint16_t ff_v8h __attribute__((vector_size(16)));
    typedef uint32_t ff_v8u __attribute__((vector_size(32)));

    /* 8 lanes of a row as float32: fp32 is loaded as is, bf16 widened (its bits are fp32's top 16). */
    static inline ff_v8f ff_load8(const void* p, int64_t i, int bf16) {
        ff_v8f r;
        if (bf16) {
            ff_v8h h; ff_v8u u;
            memcpy(&h, (const uint16_t*)p + i, 16);
            u = __builtin_convertvector(h, ff_v8u) << 16;
            memcpy(&r, &u, 32);
        } else {
            memcpy(&r, (const float*)p + i, 32);
        }
        return r;
    }

    static inline float ff_hsum8(ff_v8f v) {
        return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    }

    /* One (request, kv head): q [G, D] float32 (row stride qs), n slots, K / V element strides per
       slot (ks, vs) from the kv head's first element; out [G, D] float32 (row stride os). scores: n*G
       floats of scratch. D % 8 == 0. Returns 0. */
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __attribute__((target_clones("avx2", "default")))
    #endif
    static int ff_decode_one(const float* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs,
                             const int32_t* slots, int64_t n, int64_t G, int64_t D, float scale, int bf16,
                             float* out, int64_t os, float* scores) {
        int64_t esz = bf16 ? 2 : 4;
        for (int64_t t = 0; t < n; t++) {
            const char* row = (const char*)k + (int64_t)slots[t] * ks * esz;
            for (int64_t g = 0; g < G; g++) {
                const float* qg = q + g * qs;
                ff_v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int64_t i = 0; i < D; i += 8) {
                    ff_v8f a;
                    memcpy(&a, qg + i, 32);
                    acc += a * ff_load8(row, i, bf16);
                }
                scores[g * n + t] = ff_hsum8(acc) * scale;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float* s = scores + g * n;
            float m = -INFINITY, sum = 0.0f;
            for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
            for (int64_t t = 0; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
            float inv = 1.0f / sum;
            for (int64_t t = 0; t < n; t++) s[t] *= inv;
            memset(out + g * os, 0, D * sizeof(float));
        }
        for (int64_t t = 0; t < n; t++) {
            const char* row = (const char*)v + (int64_t)slots[t] * vs * esz;
            for (int64_t g = 0; g < G; g++) {
                float w = scores[g * n + t];
                float* o = out + g * os;
                for (int64_t i = 0; i < D; i += 8) {
                    ff_v8f a;
                    memcpy(&a, o + i, 32);
                    a += w * ff_load8(row, i, bf16);
                    memcpy(o + i, &a, 32);
                }
            }
        }
        return 0;
    }
    """
    int ff_decode_one(const float* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs,
                      const int32_t* slots, int64_t n, int64_t G, int64_t D, float scale, int bf16,
                      float* out, int64_t os, float* scores) noexcept nogil


def decode(uint64_t q_ptr, uint64_t k_ptr, uint64_t v_ptr, uint64_t out_ptr, int32_t[::1] slots,
           int64_t[::1] starts, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
           int64_t k_slot_stride, int64_t k_head_stride, int64_t v_slot_stride, int64_t v_head_stride,
           float scale, bint bf16, int threads=1):
    """Decode attention for `batch` requests, one query token each.

    q: float32 [batch, q_heads, head_dim] contiguous at q_ptr; out: float32, same shape, at out_ptr.
    k_ptr / v_ptr: one layer's key / value buffer (float32, or bfloat16 with `bf16`), element strides
    per slot and per head given; the head dim is contiguous. Request b's slots are
    slots[starts[b]:starts[b + 1]]; every slot must lie inside the buffers (the caller checks)."""
    if head_dim <= 0 or head_dim % 8:
        raise ValueError(f"paged decode: head_dim {head_dim} is not a positive multiple of 8")
    if kv_heads <= 0 or q_heads % kv_heads:
        raise ValueError(f"paged decode: {q_heads} query heads do not split over {kv_heads} kv heads")
    if starts.shape[0] != batch + 1 or starts[0] != 0 or starts[batch] != slots.shape[0]:
        raise ValueError("paged decode: starts must be batch + 1 offsets from 0 to len(slots)")
    if q_ptr == 0 or k_ptr == 0 or v_ptr == 0 or out_ptr == 0:
        raise ValueError("paged decode: null buffer pointer")
    cdef int64_t G = q_heads // kv_heads, items = batch * kv_heads, it, b, h, n, longest = 0
    cdef int64_t esz = 2 if bf16 else 4
    for b in range(batch):
        if starts[b + 1] - starts[b] <= 0:
            raise ValueError(f"paged decode: request {b} has no KV slots")
        longest = max(longest, starts[b + 1] - starts[b])
    if threads < 1:
        threads = 1
    if threads > items:
        threads = <int>items
    # scores scratch per thread, not per item: a batch of 64 long requests must not allocate
    # batch x heads x context floats at once
    cdef float* scratch = <float*>malloc(threads * G * longest * sizeof(float))
    if scratch == NULL:
        raise MemoryError("paged decode: scores scratch")
    cdef const float* q = <const float*>q_ptr
    cdef float* out = <float*>out_ptr
    try:
        with nogil:
            for it in prange(items, num_threads=threads, schedule="static"):
                b = it // kv_heads
                h = it % kv_heads
                n = starts[b + 1] - starts[b]
                ff_decode_one(q + (b * q_heads + h * G) * head_dim, head_dim,
                              <const char*>k_ptr + h * k_head_stride * esz, k_slot_stride,
                              <const char*>v_ptr + h * v_head_stride * esz, v_slot_stride,
                              &slots[starts[b]], n, G, head_dim, scale, bf16,
                              out + (b * q_heads + h * G) * head_dim, head_dim,
                              scratch + threadid() * G * longest)
    finally:
        free(scratch)
    return None
