# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled page copies between SGLang's per-layer KV buffers and host-tier page rows, with the page
checksum fused into the same pass (issue 15 part 2): each source word is read once, written once and
mixed into its page's hash while it is in a register.

A host page is the concatenation, in order, of S segments (layer-major: K then V, or the one MLA
buffer); segment s of device page d starts at seg_ptr[s] + d * seg_stride[s] and is seg_nbytes[s]
long. The flexflow_sglang/connector/copy_kernels.py wrapper builds these tables from a KVLayout and
holds the torch twin that must give the same bytes and sums.

The page hash (64-bit words w_i, i = 4 b + l: block b of nb = words / 4, lane l; mod 2**64):
    A_l = sum_b w_(4b+l);  B_l = sum_b (nb - b) w_(4b+l)     (per block: A_l += w; B_l += A_l)
    hash = sum_k mix(X_k ^ (k + 1) K),  X = (A_0..3, B_0..3),  mix(x) = y ^ (y >> 32), y = x C
A flipped bit changes A_l by +-2**p (never 0 mod 2**64); swapped words change B_l (same lane) or
two lane sums (different lanes). Either way a term of the final sum changes and the hash differs
unless the changes cancel (probability ~2**-64). Adds only in the per-word loop (vectorised), so the
checksum costs less than the memory traffic; it is not a cryptographic digest (the shared-secret
MAC is, elsewhere). Segments must be multiples of 32 bytes (4 words) to be hashed.
"""

from libc.stdint cimport int64_t, uint64_t, uint8_t
from libc.string cimport memcpy, memset
from cython.parallel cimport prange

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__x86_64__)
    #include <emmintrin.h>
    #endif
    /* dst[0:n] = src[0:n] (dst may be NULL: fold only) and every word folded into the lane sums
       st = A_0..3, B_0..3: per block of 4 words, A += w, then B += A. One pass: each 32-byte block
       is loaded once into a 4 x 64-bit vector, stored and folded while it is in a register. The
       earlier memcpy-then-fold per 16 KiB chunk left the memory idle during the fold, which cost
       most where segments are short and scattered (page size 1: 4 KiB per layer; see the fused
       kernels section of docs/results.md). target_clones builds an AVX2 body, picked at load time
       on CPUs that have it, beside a baseline x86-64 one. */
    typedef uint64_t ff_v4u __attribute__((vector_size(32)));
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __attribute__((target_clones("avx2", "default")))
    #endif
    static void ff_copy_fold(uint64_t* dst, const uint64_t* src, int64_t n, uint64_t* st) {
        ff_v4u a, b, w;
        memcpy(&a, st, 32);
        memcpy(&b, st + 4, 32);
        if (dst) {
            for (int64_t k = 0; k < n; k += 4) {
                memcpy(&w, src + k, 32);
                memcpy(dst + k, &w, 32);
                a += w;
                b += a;
            }
        } else {
            for (int64_t k = 0; k < n; k += 4) {
                memcpy(&w, src + k, 32);
                a += w;
                b += a;
            }
        }
        memcpy(st, &a, 32);
        memcpy(st + 4, &b, 32);
    }
    /* The same with non-temporal stores (dst 16-byte aligned; st NULL: copy only). A regular store
       first reads the destination line into the cache (read-for-ownership), so a move far larger
       than the cache costs three memory passes (read src, read dst, write dst) where glibc's memcpy,
       which switches to streaming stores above a size threshold, costs two: the plain copy_ the
       bench compares with. Page 1 (4 KiB segments) never reaches glibc's threshold per call. The
       caller issues ff_store_fence() after the stores of each page. `ahead` (may be NULL): the next
       segment to be read, at least n words long; one prefetch per 64-byte line of it while this one
       is copied, so that its page walk and first misses overlap this copy (a store at page size 1
       reads 4 KiB from each of 32 buffers per page: 9.2 -> 8.0 ms per 128 MiB, ad hoc A/B). */
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __attribute__((target_clones("avx2", "default")))
    #endif
    static void ff_copy_fold_nt(uint64_t* dst, const uint64_t* src, int64_t n, uint64_t* st, const uint64_t* ahead) {
    #if defined(__x86_64__)
        ff_v4u a = {0, 0, 0, 0}, b = {0, 0, 0, 0}, w;
        __m128i lo, hi;
        if (st) {
            memcpy(&a, st, 32);
            memcpy(&b, st + 4, 32);
        }
        for (int64_t k = 0; k < n; k += 4) {
            if (ahead && (k & 7) == 0) __builtin_prefetch(ahead + k, 0, 0);
            memcpy(&w, src + k, 32);
            memcpy(&lo, &w, 16);
            memcpy(&hi, (const char*)&w + 16, 16);
            _mm_stream_si128((__m128i*)(dst + k), lo);
            _mm_stream_si128((__m128i*)(dst + k + 2), hi);
            a += w;
            b += a;
        }
        if (st) {
            memcpy(st, &a, 32);
            memcpy(st + 4, &b, 32);
        }
    #else
        (void)ahead;
        if (st) ff_copy_fold(dst, src, n, st); else memcpy(dst, src, (size_t)n * 8);
    #endif
    }
    static inline void ff_store_fence(void) {
    #if defined(__x86_64__)
        _mm_sfence();
    #endif
    }
    static inline int ff_nt_capable(void) {
    #if defined(__x86_64__)
        return 1;
    #else
        return 0;
    #endif
    }
    """
    void ff_copy_fold(uint64_t* dst, const uint64_t* src, int64_t n, uint64_t* st) noexcept nogil
    void ff_copy_fold_nt(uint64_t* dst, const uint64_t* src, int64_t n, uint64_t* st, const uint64_t* ahead) noexcept nogil
    void ff_store_fence() noexcept nogil
    int ff_nt_capable() noexcept nogil

cdef uint64_t HASH_K = 0x9E3779B97F4A7C15ULL
cdef uint64_t HASH_C = 0xBF58476D1CE4E5B9ULL


cdef inline uint64_t _finish(uint64_t* st) noexcept nogil:
    """The page hash from its lane sums: sum_k mix((k + 1) * K ^ st[k]), mix = multiply by an odd
    constant then xor-shift (a bijection, so one changed lane sum always changes its term)."""
    cdef uint64_t h = 0, m
    cdef int k
    for k in range(8):
        m = (st[k] ^ (<uint64_t>(k + 1) * HASH_K)) * HASH_C
        h += m ^ (m >> 32)
    return h


cdef int _check_tables(seg_ptr, seg_stride, seg_nbytes, bint hashing) except -1:
    cdef Py_ssize_t s
    if not (len(seg_ptr) == len(seg_stride) == len(seg_nbytes)) or len(seg_ptr) == 0:
        raise ValueError("copy kernels: segment tables differ in length or are empty")
    if hashing:
        for s in range(len(seg_nbytes)):
            if seg_nbytes[s] % 32:
                raise ValueError(f"copy kernels: segment {s} is {seg_nbytes[s]} B, not a multiple of 32 (no hash)")
    return 0


cdef bint _nt_ok(seg_nbytes, bint nt, dst_ptrs, dst_strides) except -1:
    """Streaming stores need every segment a whole number of 32-byte blocks and every destination
    16-byte aligned; otherwise the regular stores are used (same bytes, same sums)."""
    cdef Py_ssize_t s
    if not nt or not ff_nt_capable():
        return False
    for s in range(len(seg_nbytes)):
        if seg_nbytes[s] % 32:
            return False
    for s in range(len(dst_ptrs)):
        if dst_ptrs[s] % 16 or dst_strides[s] % 16:
            return False
    return True


def gather(uint64_t[::1] seg_ptr, int64_t[::1] seg_stride, int64_t[::1] seg_nbytes, int64_t[::1] dev_pages,
           uint64_t host_ptr, int64_t host_row_nbytes, int64_t[::1] host_pages, int64_t[::1] sums=None,
           int threads=1, bint nt=False):
    """Store: device page dev_pages[i] -> host row host_pages[i] (all segments, in page order); with
    `sums`, sums[i] = the hash of that page, computed from the words as they are copied. `nt`:
    streaming (non-temporal) stores where the layout allows them (for moves larger than the cache)."""
    cdef Py_ssize_t n = dev_pages.shape[0], S = seg_ptr.shape[0], i, s
    cdef bint hashing = sums is not None
    _check_tables(seg_ptr, seg_stride, seg_nbytes, hashing)
    if host_pages.shape[0] != n or (hashing and sums.shape[0] != n):
        raise ValueError("copy kernels: dev_pages, host_pages and sums differ in length")
    cdef uint8_t* row
    cdef const uint8_t* src
    nt = _nt_ok(seg_nbytes, nt, (host_ptr,), (host_row_nbytes,))
    if threads < 1:
        threads = 1
    with nogil:
        for i in prange(n, num_threads=threads, schedule="static"):
            _gather_page(&seg_ptr[0], &seg_stride[0], &seg_nbytes[0], S, dev_pages[i],
                         <uint8_t*>host_ptr + host_pages[i] * host_row_nbytes, hashing,
                         &sums[i] if hashing else NULL, nt)
    return None


cdef void _gather_page(const uint64_t* seg_ptr, const int64_t* seg_stride, const int64_t* seg_nbytes,
                       Py_ssize_t S, int64_t dev_page, uint8_t* row, bint hashing, int64_t* sum_out,
                       bint nt) noexcept nogil:
    cdef uint64_t st[8]
    cdef Py_ssize_t s
    cdef const uint8_t* src
    memset(st, 0, sizeof(st))
    for s in range(S):
        src = <const uint8_t*>seg_ptr[s] + dev_page * seg_stride[s]
        if nt:
            # the next segment lives in another buffer, in another virtual page: start reading it
            # (page walk, first lines) while this one is copied
            ff_copy_fold_nt(<uint64_t*>row, <const uint64_t*>src, seg_nbytes[s] >> 3, st if hashing else NULL,
                            <const uint64_t*>(<const uint8_t*>seg_ptr[s + 1] + dev_page * seg_stride[s + 1])
                            if s + 1 < S and seg_nbytes[s + 1] >= seg_nbytes[s] else NULL)
        elif hashing:
            ff_copy_fold(<uint64_t*>row, <const uint64_t*>src, seg_nbytes[s] >> 3, st)
        else:
            memcpy(row, src, seg_nbytes[s])
        row += seg_nbytes[s]
    if nt:
        ff_store_fence()  # this page's streaming stores are visible before the caller uses the row
    if hashing:
        sum_out[0] = <int64_t>_finish(st)


cdef bint _scatter_page(const uint8_t* row, const uint64_t* seg_ptr, const int64_t* seg_stride,
                        const int64_t* seg_nbytes, Py_ssize_t S, int64_t dev_page, bint hashing,
                        int64_t expect, bint nt) noexcept nogil:
    """Copies one page; True when hashing and its hash differs from expect."""
    cdef uint64_t st[8]
    cdef Py_ssize_t s
    cdef uint8_t* dst
    memset(st, 0, sizeof(st))
    for s in range(S):
        dst = <uint8_t*>seg_ptr[s] + dev_page * seg_stride[s]
        if nt:
            ff_copy_fold_nt(<uint64_t*>dst, <const uint64_t*>row, seg_nbytes[s] >> 3, st if hashing else NULL, NULL)
        elif hashing:
            ff_copy_fold(<uint64_t*>dst, <const uint64_t*>row, seg_nbytes[s] >> 3, st)
        else:
            memcpy(dst, row, seg_nbytes[s])
        row += seg_nbytes[s]
    if nt:
        ff_store_fence()
    return hashing and <int64_t>_finish(st) != expect


def scatter(uint64_t host_ptr, int64_t host_row_nbytes, int64_t[::1] host_pages, uint64_t[::1] seg_ptr,
            int64_t[::1] seg_stride, int64_t[::1] seg_nbytes, int64_t[::1] dev_pages, int64_t[::1] expect=None,
            int threads=1, unsigned char[::1] bad_flags=None, bint nt=False):
    """Load: host row host_pages[i] -> device page dev_pages[i]. With `expect`, each page's hash is
    computed while it is copied and the index of the first page whose hash differs from expect[i] is
    returned (-1: all match). The copy does not stop there: the caller treats the whole load as a miss
    and the slots it was given hold no token anyone reads."""
    cdef Py_ssize_t n = dev_pages.shape[0], S = seg_ptr.shape[0], i, s
    cdef bint hashing = expect is not None
    cdef Py_ssize_t bad = -1
    _check_tables(seg_ptr, seg_stride, seg_nbytes, hashing)
    if host_pages.shape[0] != n or (hashing and expect.shape[0] != n):
        raise ValueError("copy kernels: dev_pages, host_pages and expect differ in length")
    cdef const uint8_t* row
    cdef uint8_t* dst
    if threads < 1:
        threads = 1
    if hashing and (bad_flags is None or bad_flags.shape[0] < n):
        raise ValueError("copy kernels: scatter with expect needs bad_flags of n bytes")
    nt = _nt_ok(seg_nbytes, nt, seg_ptr, seg_stride)
    with nogil:
        for i in prange(n, num_threads=threads, schedule="static"):
            if _scatter_page(<const uint8_t*>host_ptr + host_pages[i] * host_row_nbytes, &seg_ptr[0],
                             &seg_stride[0], &seg_nbytes[0], S, dev_pages[i], hashing,
                             expect[i] if hashing else 0, nt):
                bad_flags[i] = 1
            elif hashing:
                bad_flags[i] = 0
        if hashing:
            for i in range(n):
                if bad_flags[i]:
                    bad = i
                    break
    return bad


def hash_rows(uint64_t base_ptr, int64_t row_stride, int64_t row_nbytes, int64_t[::1] rows, int64_t[::1] out):
    """out[i] = the page hash of the row_nbytes bytes at base_ptr + rows[i] * row_stride (one read,
    no copy, GIL released for all rows): host-tier rows (stride = row length) and the deep tiers'
    payload checksum (a storage file's page, read into any strided buffer)."""
    cdef Py_ssize_t n = rows.shape[0], i
    cdef uint64_t st[8]
    if row_nbytes % 32:
        raise ValueError(f"copy kernels: row of {row_nbytes} B is not a multiple of 32 (no hash)")
    if out.shape[0] != n:
        raise ValueError("copy kernels: rows and out differ in length")
    with nogil:
        for i in range(n):
            memset(st, 0, sizeof(st))
            ff_copy_fold(NULL, <const uint64_t*>(<const uint8_t*>base_ptr + rows[i] * row_stride),
                       row_nbytes >> 3, st)
            out[i] = <int64_t>_finish(st)
    return None


# CRC32 of many tier pages in one call (the storage / remote wire format stays zlib's CRC32).
# zlib's crc32 is reached through a function pointer that the caller takes from the libz Python's
# own zlib module uses (ctypes), so the build needs no zlib headers. One call sums every row with
# the GIL released for all of them: one zlib.crc32 call per page re-acquires the GIL per page and
# waits behind SGLang's scheduler thread each time (2.8 s for 1,560 pages measured while it decoded).
ctypedef unsigned long (*crc32_fn)(unsigned long, const unsigned char*, unsigned int) noexcept nogil

cdef unsigned long _crc_row(crc32_fn fn, const unsigned char* p, int64_t n) noexcept nogil:
    cdef unsigned long c = fn(0, NULL, 0)
    cdef int64_t step
    while n > 0:
        step = n if n < (1 << 30) else (1 << 30)   # zlib takes a 32-bit length
        c = fn(c, p, <unsigned int>step)
        p += step
        n -= step
    return c


def crc32_rows(uint64_t fn_ptr, uint64_t base_ptr, int64_t row_stride, int64_t row_nbytes,
               int64_t[::1] rows, int64_t[::1] out, int nthreads=1):
    """out[i] = CRC32 (zlib) of the row_nbytes bytes at base_ptr + rows[i] * row_stride."""
    cdef Py_ssize_t n = rows.shape[0], i
    cdef crc32_fn fn = <crc32_fn>fn_ptr
    if fn_ptr == 0 or base_ptr == 0:
        raise ValueError("crc32_rows: null function or buffer pointer")
    if out.shape[0] != n:
        raise ValueError("crc32_rows: rows and out differ in length")
    if row_nbytes < 0 or row_stride < 0:
        raise ValueError(f"crc32_rows: negative row size {row_nbytes} or stride {row_stride}")
    if nthreads > 1 and n > 1:
        for i in prange(n, nogil=True, num_threads=nthreads, schedule="static"):
            out[i] = <int64_t>_crc_row(fn, <const unsigned char*>base_ptr + rows[i] * row_stride, row_nbytes)
    else:
        with nogil:
            for i in range(n):
                out[i] = <int64_t>_crc_row(fn, <const unsigned char*>base_ptr + rows[i] * row_stride,
                                           row_nbytes)
    return None
