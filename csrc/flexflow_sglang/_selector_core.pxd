# Typed contract of the selector's compiled scoring core. Python (flexflow_sglang/selector/)
# prepares every array once per (src, dst) pair and topology; the loops below see only these.
# The pure-Python twin (flexflow_sglang/selector/_core_py.py) mirrors _selector_core.pyx
# operation for operation, so both give identical floating-point results and decisions.

cdef enum:
    PT_DIRECT = 0
    PT_NVLINK_RELAY = 1
    PT_CROSSNODE_RELAY = 2
    PT_SPLIT = 3
    PT_STORAGE_RELAY = 4

# params[] layout: typed copies of flexflow_sglang/selector/cost_model.py's P_* (PARAM_NAMES order,
# built by cost_model.pack_params); tests/selector/test_cost_model.py checks they are equal
cdef enum:
    P_W_BW = 0
    P_W_Q = 1
    P_W_HOPS = 2
    P_W_QOS = 3
    P_W_LAT = 4
    P_RELAY_MARGIN = 5
    P_SPLIT_MARGIN = 6
    P_ENABLE_SPLIT = 7
    P_MAX_SPLIT = 8
    P_RELAY_CHUNK = 9
    P_RELAY_OVERHEAD_US = 10
    P_NPARAMS = 11

cimport cython

# one select()'s result (cost_model.CoreResult's fields; indices and shares of n <= 8 legs; a
# single path's share is int(nbytes))
ctypedef struct Result:
    int kind
    int n
    int reason
    int aux_link
    int aux_path
    bint qos
    double bw
    double est
    double gain
    double cost
    double aux_util
    double nbytes
    int idx[8]
    long long sh[8]

@cython.final
cdef class PairCore:
    cdef int n_paths
    cdef int[::1] ptype
    cdef int[::1] ptr
    cdef int[::1] plinks
    cdef double[::1] fixed_lat
    cdef int[::1] nrelay
    cdef double[::1] extra_hops
    cdef unsigned char[::1] disjoint
    cdef double[::1] cap
    cdef double[::1] thr
    cdef double[::1] util
    cdef double[::1] qdelay
    cdef double[::1] params
    # per-call scratch, sized n_paths
    cdef double* s_bw
    cdef double* s_cost
    cdef double* s_est
    cdef double* s_tl
    cdef double* s_q
    cdef double* s_risk
    cdef int* s_rej
    cdef int* s_worst
    cdef int* s_order
    cdef int* s_sel
    # the equal-finish shares of the split last costed (MAX_SPLIT_CAP); the other per-leg scratch
    # of _set_cost is on its stack
    cdef double* s_sh

    cdef void _score(self, double nbytes, bint ttft) noexcept nogil
    cdef double _set_cost(self, int* sel, int n, double nbytes, bint ttft, double* est_out,
                          double* bw_out) noexcept nogil
    cdef double _pair_bound(self, int a, int b, double nbytes, bint ttft) noexcept nogil
    cdef bint _disjoint_with(self, int c, int* sel, int n) noexcept nogil
    cdef bint _run(self, double nbytes, bint ttft, Result* res) noexcept nogil
