# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Decode and short-suffix extend attention read straight from SGLang's paged KV buffers
(`--attention-backend flexflow_sdpa`, backend/prefix_sdpa.py).

Why: SGLang's CPU backends (torch_native) gather every request's keys and values into new tensors
(`k_cache[tokens]`) on every layer of every step, then run SDPA over the copies: the KV is read
twice and written once. On the kv128k preset (128 KB of KV per token) a decode step of 2 requests
x 1,300 tokens took 144.7 ms of attention that way, 27.8 ms here (2 threads;
`python benchmarks/paged_decode.py` at 1737bed, docs/results-data-plane.md). GPU backends
(FlashInfer's paged decode and prefill) read the pages in place; so does this kernel: one read of
each key row and each value row per block of query rows, nothing written but the output. A prefix
hit's extend with a short suffix is the same shape as a decode with several query rows, so it runs
here too (`extend`; the row limit where SDPA's GEMMs win instead: `python benchmarks/paged_extend.py`).

What it computes, per query row (request b, new token j, query head h; kv head h / G, G = query
heads per kv head), over the slots t the row may see (all of a decode's; an extend's cached prefix
and new tokens 0 .. j):
    s_t = scale * q[b, j, h] . K[slot_t, h / G]
    out[b, j, h] = sum_t softmax(s)_t V[slot_t, h / G]
in float32 (bfloat16 KV is widened on load), the same as SDPA's math up to rounding. The order of
every sum is fixed by this code and depends only on the row's own inputs (not on its block or
thread), so the bytes do not depend on the thread count: a host hit, a device hit and any TP
layout give the same result.
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
    typedef int32_t ff_v8i __attribute__((vector_size(32)));

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

    /* the lane sums of a[0..7] as one vector: lane c = ((a_c[0] + a_c[1]) + (a_c[2] + a_c[3])) +
       ((a_c[4] + a_c[5]) + (a_c[6] + a_c[7])), the same pairing for every lane */
    static inline ff_v8f ff_sums8(const ff_v8f* a) {
        const ff_v8i ev = {0, 8, 2, 10, 4, 12, 6, 14}, od = {1, 9, 3, 11, 5, 13, 7, 15};
        const ff_v8i lo = {0, 1, 8, 9, 4, 5, 12, 13}, hi = {2, 3, 10, 11, 6, 7, 14, 15};
        const ff_v8i h0 = {0, 1, 2, 3, 8, 9, 10, 11}, h1 = {4, 5, 6, 7, 12, 13, 14, 15};
        ff_v8f b[4], c[2];
        for (int p = 0; p < 4; p++)
            b[p] = __builtin_shuffle(a[2 * p], a[2 * p + 1], ev) + __builtin_shuffle(a[2 * p], a[2 * p + 1], od);
        for (int p = 0; p < 2; p++)
            c[p] = __builtin_shuffle(b[2 * p], b[2 * p + 1], lo) + __builtin_shuffle(b[2 * p], b[2 * p + 1], hi);
        return __builtin_shuffle(c[0], c[1], h0) + __builtin_shuffle(c[0], c[1], h1);
    }

    /* lanes of a where mask (all ones), else b's */
    static inline ff_v8f ff_sel(ff_v8i mask, ff_v8f a, ff_v8f b) {
        return (ff_v8f)(((ff_v8i)a & mask) | ((ff_v8i)b & ~mask));
    }

    /* exp of 8 lanes, x <= 0 (softmax after the max is subtracted): Cody-Waite range reduction and
       Cephes' degree-6 polynomial for expf (about 1 ulp), written out so that the result is the same
       on every build and needs no libmvec; below -87.3 (e^x under FLT_MIN) it is 0 */
    static inline ff_v8f ff_exp8(ff_v8f x) {
        ff_v8i under = x < -87.33654f;
        x = ff_sel(under, (ff_v8f){0} - 87.33654f, x);
        ff_v8f t = x * 1.44269504088896341f + 0.5f;
        ff_v8i ki = __builtin_convertvector(t, ff_v8i);
        ki -= (ff_v8i)(__builtin_convertvector(ki, ff_v8f) > t) & 1;   /* floor for negatives */
        ff_v8f kf = __builtin_convertvector(ki, ff_v8f);
        ff_v8f r = x - kf * 0.693359375f - kf * -2.12194440e-4f;
        ff_v8f y = (ff_v8f){0} + 1.9875691500e-4f;
        y = y * r + 1.3981999507e-3f;
        y = y * r + 8.3334519073e-3f;
        y = y * r + 4.1665795894e-2f;
        y = y * r + 1.6666665459e-1f;
        y = y * r + 5.0000001201e-1f;
        y = y * (r * r) + r + 1.0f;
        ff_v8i bits = (ki + 127) << 23;
        ff_v8f scale2;
        memcpy(&scale2, &bits, 32);
        y = y * scale2;
        return (ff_v8f)((ff_v8i)y & ~under);
    }

    /* softmax of s[0 .. n-1] in place: max, e^(s - max), sum in 8 lanes then ff_hsum8, scale */
    static inline void ff_softmax(float* s, int64_t n) {
        ff_v8f mv = {0}, sv = {0};
        mv -= INFINITY;
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) { ff_v8f x; memcpy(&x, s + t, 32); mv = ff_sel(x > mv, x, mv); }
        float m = -INFINITY;
        for (int c = 0; c < 8; c++) m = mv[c] > m ? mv[c] : m;
        for (int64_t u = t; u < n; u++) m = s[u] > m ? s[u] : m;
        for (t = 0; t + 8 <= n; t += 8) {
            ff_v8f x; memcpy(&x, s + t, 32);
            x = ff_exp8(x - m); sv += x; memcpy(s + t, &x, 32);
        }
        if (t < n) {  /* the tail through the same lanes, padded with -inf (e^-inf = 0) */
            ff_v8f x = {0}; x -= INFINITY;
            for (int64_t u = t; u < n; u++) x[u - t] = s[u];
            x = ff_exp8(x - m); sv += x;
            for (int64_t u = t; u < n; u++) s[u] = x[u - t];
        }
        float sum = ff_hsum8(sv);
        ff_v8f inv = {0}; inv += 1.0f / sum;
        for (t = 0; t + 8 <= n; t += 8) { ff_v8f x; memcpy(&x, s + t, 32); x *= inv; memcpy(s + t, &x, 32); }
        for (; t < n; t++) s[t] *= inv[0];
    }

    #define FF_TILE 8  /* keys per value tile: a slot's rows are often 4 KB apart, so a head's slices of
                          more keys than L1's 8 ways map onto the same sets and evict each other */
    #define FF_PACK_TILE 64     /* keys per packed value tile (64 x D floats of scratch) */
    #define FF_PACK_MIN_ROWS 4  /* fewer rows (decode) read the values in place: packing would read
                                   and write each value once more for too few rows to share it */

    /* oc[r] += sum over keys t0 <= t < t1 that row r sees (t < lim0 + r / G) of w_rt V_t, in t order:
       rp[t - t0] is key t's value row (bf16 or float32). Two rows share each value load, 32 lanes per
       pass (8 accumulators in registers). */
    static inline void ff_weighted_rows(const char* const* rp, int bf16, int64_t t0, int64_t t1, int64_t R,
                                        int64_t G, int64_t lim0, int64_t D, const float* scores, int64_t n,
                                        float* oc) {
        for (int64_t r0 = 0; r0 < R; r0 += 2) {
            int64_t r1 = r0 + 1 < R ? r0 + 1 : r0;
            int64_t ea = lim0 + r0 / G, eb = lim0 + r1 / G;
            ea = ea < t1 ? ea : t1; eb = eb < t1 ? eb : t1;
            if (eb <= t0) continue;
            float* o0 = oc + r0 * D;
            float* o1 = oc + r1 * D;
            const float* w0 = scores + r0 * n;
            const float* w1 = scores + r1 * n;
            for (int64_t d = 0; d < D; d += 32) {
                ff_v8f a0, a1, a2, a3, b0, b1, b2, b3;
                memcpy(&a0, o0 + d, 32); memcpy(&a1, o0 + d + 8, 32);
                memcpy(&a2, o0 + d + 16, 32); memcpy(&a3, o0 + d + 24, 32);
                memcpy(&b0, o1 + d, 32); memcpy(&b1, o1 + d + 8, 32);
                memcpy(&b2, o1 + d + 16, 32); memcpy(&b3, o1 + d + 24, 32);
                int64_t t = t0;
                for (; t < ea; t++) {
                    const char* row = rp[t - t0];
                    ff_v8f x0 = ff_load8(row, d, bf16), x1 = ff_load8(row, d + 8, bf16);
                    ff_v8f x2 = ff_load8(row, d + 16, bf16), x3 = ff_load8(row, d + 24, bf16);
                    float wa = w0[t], wb = w1[t];
                    a0 += wa * x0; a1 += wa * x1; a2 += wa * x2; a3 += wa * x3;
                    b0 += wb * x0; b1 += wb * x1; b2 += wb * x2; b3 += wb * x3;
                }
                for (; t < eb; t++) {  /* keys only the later row's token sees */
                    const char* row = rp[t - t0];
                    float wb = w1[t];
                    b0 += wb * ff_load8(row, d, bf16); b1 += wb * ff_load8(row, d + 8, bf16);
                    b2 += wb * ff_load8(row, d + 16, bf16); b3 += wb * ff_load8(row, d + 24, bf16);
                }
                /* r1 == r0 (an odd last row): b holds the same row's sums, and a, stored last, wins */
                memcpy(o1 + d, &b0, 32); memcpy(o1 + d + 8, &b1, 32);
                memcpy(o1 + d + 16, &b2, 32); memcpy(o1 + d + 24, &b3, 32);
                memcpy(o0 + d, &a0, 32); memcpy(o0 + d + 8, &a1, 32);
                memcpy(o0 + d + 16, &a2, 32); memcpy(o0 + d + 24, &a3, 32);
            }
        }
    }

    /* One (request, kv head, block of T query tokens): G query heads per token share the kv head, so
       the block is R = T*G query rows that read each key and value row once. Row (j, g) is
       q + j*qts + g*D (float32) and sees the first lim0 + j of the request's slots (decode: T = 1,
       lim0 = n; extend: token j of the block sits at position lim0 - 1 + j, so the causal mask is this
       bound). K / V element strides per slot (ks, vs) from the kv head's first element; out rows like
       q's (ots). scratch: R*(lim0 + T - 1) + 2*R*D + FF_PACK_TILE*D floats. D % 32 == 0. The order
       of every sum is fixed here and depends only on the row's own inputs, not on the block or the
       thread (packed or in place, a value is the same float32 and is added in t order). x86-64-v3 brings
       FMA (the extension builds with -ffp-contract=fast): the clone is chosen once per machine, so a
       host hit and a device hit run the same instructions. */
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __attribute__((target_clones("arch=x86-64-v3", "default")))
    #endif
    static void ff_attend_block(const float* q, int64_t qts, const void* k, int64_t ks, const void* v,
                                int64_t vs, const int32_t* slots, int64_t lim0, int64_t T, int64_t G,
                                int64_t D, float scale, int bf16, float* out, int64_t ots, float* scores) {
        int64_t esz = bf16 ? 2 : 4, n = lim0 + T - 1, R = T * G;
        float* qc = scores + R * n;
        float* oc = qc + R * D;
        for (int64_t r = 0; r < R; r++) memcpy(qc + r * D, q + (r / G) * qts + (r % G) * D, D * sizeof(float));
        const char* rp[FF_TILE];
        /* scores, 8 keys x 1 row per step: the 8 key rows stay in L1 across the block's rows */
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
            int64_t nk = n - t0 < 8 ? n - t0 : 8;
            for (int c = 0; c < 8; c++)
                rp[c] = (const char*)k + (int64_t)slots[t0 + (c < nk ? c : nk - 1)] * ks * esz;
            for (int64_t r = 0; r < R; r++) {
                if (t0 >= lim0 + r / G) continue;   /* token r / G sees slot t iff t < lim0 + r / G */
                const float* qr = qc + r * D;
                ff_v8f a[8] = {{0}};
                for (int64_t i = 0; i < D; i += 8) {
                    ff_v8f x;
                    memcpy(&x, qr + i, 32);
                    for (int c = 0; c < 8; c++) a[c] += x * ff_load8(rp[c], i, bf16);
                }
                ff_v8f s = ff_sums8(a) * scale;
                if (nk == 8) memcpy(scores + r * n + t0, &s, 32);
                else for (int c = 0; c < nk; c++) scores[r * n + t0 + c] = s[c];
            }
        }
        for (int64_t r = 0; r < R; r++) {
            int64_t lim = lim0 + r / G;
            ff_softmax(scores + r * n, lim);
            memset(oc + r * D, 0, D * sizeof(float));
        }
        /* out += w_t V_t in t order, a tile of keys at a time, so that the tile's value rows stay in
           cache across the block's rows */
        const char* vp[FF_PACK_TILE];
        if (R >= FF_PACK_MIN_ROWS) {
            /* enough rows to pay for packing: a tile's value rows copied contiguous (bf16 widened once),
               so the tile can be longer than L1's ways allow for rows a slot stride apart */
            float* vt = oc + R * D;
            for (int64_t t0 = 0; t0 < n; t0 += FF_PACK_TILE) {
                int64_t t1 = t0 + FF_PACK_TILE < n ? t0 + FF_PACK_TILE : n;
                for (int64_t t = t0; t < t1; t++) {
                    const char* row = (const char*)v + (int64_t)slots[t] * vs * esz;
                    for (int64_t i = 0; i < D; i += 8) {
                        ff_v8f x = ff_load8(row, i, bf16);
                        memcpy(vt + (t - t0) * D + i, &x, 32);
                    }
                    vp[t - t0] = (const char*)(vt + (t - t0) * D);
                }
                ff_weighted_rows(vp, 0, t0, t1, R, G, lim0, D, scores, n, oc);
            }
        } else {
            for (int64_t t0 = 0; t0 < n; t0 += FF_TILE) {
                int64_t t1 = t0 + FF_TILE < n ? t0 + FF_TILE : n;
                for (int64_t t = t0; t < t1; t++) vp[t - t0] = (const char*)v + (int64_t)slots[t] * vs * esz;
                ff_weighted_rows(vp, bf16, t0, t1, R, G, lim0, D, scores, n, oc);
            }
        }
        for (int64_t r = 0; r < R; r++) memcpy(out + (r / G) * ots + (r % G) * D, oc + r * D, D * sizeof(float));
    }
    """
    enum: FF_PACK_TILE
    void ff_attend_block(const float* q, int64_t qts, const void* k, int64_t ks, const void* v, int64_t vs,
                         const int32_t* slots, int64_t lim0, int64_t T, int64_t G, int64_t D, float scale,
                         int bf16, float* out, int64_t ots, float* scores) noexcept nogil


def decode(uint64_t q_ptr, uint64_t k_ptr, uint64_t v_ptr, uint64_t out_ptr, int32_t[::1] slots,
           int64_t[::1] starts, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
           int64_t k_slot_stride, int64_t k_head_stride, int64_t v_slot_stride, int64_t v_head_stride,
           float scale, bint bf16, int threads=1):
    """Decode attention for `batch` requests, one query token each.

    q: float32 [batch, q_heads, head_dim] contiguous at q_ptr; out: float32, same shape, at out_ptr.
    k_ptr / v_ptr: one layer's key / value buffer (float32, or bfloat16 with `bf16`), element strides
    per slot and per head given; the head dim is contiguous. Request b's slots are
    slots[starts[b]:starts[b + 1]]; every slot must lie inside the buffers (the caller checks)."""
    if head_dim <= 0 or head_dim % 32:
        raise ValueError(f"paged decode: head_dim {head_dim} is not a positive multiple of 32")
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
    cdef int64_t per_thread = G * longest + 2 * G * head_dim + FF_PACK_TILE * head_dim
    cdef float* scratch = <float*>malloc(threads * per_thread * sizeof(float))
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
                ff_attend_block(q + (b * q_heads + h * G) * head_dim, q_heads * head_dim,
                                <const char*>k_ptr + h * k_head_stride * esz, k_slot_stride,
                                <const char*>v_ptr + h * v_head_stride * esz, v_slot_stride,
                                &slots[starts[b]], n, 1, G, head_dim, scale, bf16,
                                out + (b * q_heads + h * G) * head_dim, q_heads * head_dim,
                                scratch + threadid() * per_thread)
    finally:
        free(scratch)
    return None


# query rows (tokens x query heads per kv head) per block: a block reads each of its request's key
# and value rows once, and its scores scratch is rows x context floats per thread
DEF ROWS_PER_BLOCK = 64


def extend(uint64_t q_ptr, uint64_t k_ptr, uint64_t v_ptr, uint64_t out_ptr, int32_t[::1] slots,
           int64_t[::1] starts, int64_t[::1] q_offsets, int64_t[::1] new_lens, int64_t batch,
           int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t k_slot_stride,
           int64_t k_head_stride, int64_t v_slot_stride, int64_t v_head_stride, float scale, bint bf16,
           int threads=1):
    """Extend attention for `batch` requests whose new tokens follow a cached prefix.

    Request b has new_lens[b] new tokens, the rows q_offsets[b] .. q_offsets[b] + new_lens[b] - 1 of
    q / out (float32 [tokens, q_heads, head_dim] contiguous), and the slots
    slots[starts[b]:starts[b + 1]]: its cached prefix then its new tokens' own (already written) KV.
    New token i sees the prefix and new tokens 0 .. i (the causal mask shifted by the prefix).
    Rows of out that belong to no request are not written. Buffers as in `decode`."""
    if head_dim <= 0 or head_dim % 32:
        raise ValueError(f"paged extend: head_dim {head_dim} is not a positive multiple of 32")
    if kv_heads <= 0 or q_heads % kv_heads:
        raise ValueError(f"paged extend: {q_heads} query heads do not split over {kv_heads} kv heads")
    if starts.shape[0] != batch + 1 or starts[0] != 0 or starts[batch] != slots.shape[0]:
        raise ValueError("paged extend: starts must be batch + 1 offsets from 0 to len(slots)")
    if q_offsets.shape[0] != batch or new_lens.shape[0] != batch:
        raise ValueError("paged extend: q_offsets and new_lens need one entry per request")
    if q_ptr == 0 or k_ptr == 0 or v_ptr == 0 or out_ptr == 0:
        raise ValueError("paged extend: null buffer pointer")
    cdef int64_t G = q_heads // kv_heads, tokens_per_block = max(1, ROWS_PER_BLOCK // G)
    cdef int64_t b, blocks = 0, longest = 0, it, items, r, h, j0, nt, n, esz = 2 if bf16 else 4
    for b in range(batch):
        n = starts[b + 1] - starts[b]
        if new_lens[b] <= 0 or new_lens[b] > n:
            raise ValueError(f"paged extend: request {b} has {new_lens[b]} new tokens for {n} KV slots")
        blocks += (new_lens[b] + tokens_per_block - 1) // tokens_per_block
        longest = max(longest, n)
    items = blocks * kv_heads
    if items == 0:
        return None
    threads = max(1, min(threads, <int>items))
    # (request, first token) of every block; item = block * kv_heads + kv head
    cdef int64_t* block_req = <int64_t*>malloc(blocks * sizeof(int64_t))
    cdef int64_t* block_tok = <int64_t*>malloc(blocks * sizeof(int64_t))
    cdef int64_t rows = tokens_per_block * G, per_thread = rows * longest + 2 * rows * head_dim + FF_PACK_TILE * head_dim
    cdef float* scratch = <float*>malloc(threads * per_thread * sizeof(float))
    if block_req == NULL or block_tok == NULL or scratch == NULL:
        free(block_req); free(block_tok); free(scratch)
        raise MemoryError("paged extend: block table or scores scratch")
    r = 0
    for b in range(batch):
        j0 = 0
        while j0 < new_lens[b]:
            block_req[r] = b
            block_tok[r] = j0
            r += 1
            j0 += tokens_per_block
    cdef const float* q = <const float*>q_ptr
    cdef float* out = <float*>out_ptr
    cdef int64_t row_stride = q_heads * head_dim
    try:
        with nogil:
            for it in prange(items, num_threads=threads, schedule="static"):
                r = it // kv_heads
                h = it % kv_heads
                b = block_req[r]
                j0 = block_tok[r]
                nt = min(tokens_per_block, new_lens[b] - j0)
                n = starts[b + 1] - starts[b]
                ff_attend_block(q + ((q_offsets[b] + j0) * q_heads + h * G) * head_dim, row_stride,
                                <const char*>k_ptr + h * k_head_stride * esz, k_slot_stride,
                                <const char*>v_ptr + h * v_head_stride * esz, v_slot_stride,
                                &slots[starts[b]], n - new_lens[b] + j0 + 1, nt, G, head_dim, scale, bf16,
                                out + ((q_offsets[b] + j0) * q_heads + h * G) * head_dim, row_stride,
                                scratch + threadid() * per_thread)
    finally:
        free(block_req); free(block_tok); free(scratch)
    return None
