# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled scoring core of the flexFlow path selector.

One PairCore per (src, dst) pair holds that pair's candidate paths as flat typed arrays plus
views of the topology-wide link arrays (capacity, QoS threshold) and of the NodeAgent's live
link state (utilisation, queue delay), which the agent updates in place: reading them never
takes a lock. `select()` scores every candidate, filters by QoS, applies the relay and split
margins and returns a plain tuple, laid out as flexflow_sglang/selector/cost_model.py's CoreResult,
that Python wraps into a PathDecision.

Keep in lock-step with flexflow_sglang/selector/_core_py.py (same operations, same order).
"""

cimport cython
from libc.stdlib cimport malloc, free
from cpython.object cimport PyObject, PyTypeObject
from cpython.type cimport PyType_IsSubtype
from cpython.dict cimport PyDict_GetItem

# typed copies of the cost model's constants (flexflow_sglang/selector/cost_model.py; layout() below
# returns them for tests/selector/test_cost_model.py, which checks they are equal)
cdef double MIN_AVAIL_FRAC = 0.01
cdef double TTFT_HOP_FACTOR = 4.0
cdef double TTFT_LAT_FACTOR = 2.0
cdef int SPLIT_TOP = 8
cdef int MAX_SPLIT_CAP = 8


def layout():
    """This build's constants by name: the params indices (P_*), the path type codes (PT_*) and the
    scoring constants, as compiled in."""
    return {"P_W_BW": P_W_BW, "P_W_Q": P_W_Q, "P_W_HOPS": P_W_HOPS, "P_W_QOS": P_W_QOS, "P_W_LAT": P_W_LAT,
            "P_RELAY_MARGIN": P_RELAY_MARGIN, "P_SPLIT_MARGIN": P_SPLIT_MARGIN, "P_ENABLE_SPLIT": P_ENABLE_SPLIT,
            "P_MAX_SPLIT": P_MAX_SPLIT, "P_RELAY_CHUNK": P_RELAY_CHUNK, "P_RELAY_OVERHEAD_US": P_RELAY_OVERHEAD_US,
            "P_NPARAMS": P_NPARAMS,
            "PT_DIRECT": PT_DIRECT, "PT_NVLINK_RELAY": PT_NVLINK_RELAY, "PT_CROSSNODE_RELAY": PT_CROSSNODE_RELAY,
            "PT_SPLIT": PT_SPLIT, "PT_STORAGE_RELAY": PT_STORAGE_RELAY,
            "MIN_AVAIL_FRAC": MIN_AVAIL_FRAC, "TTFT_HOP_FACTOR": TTFT_HOP_FACTOR,
            "TTFT_LAT_FACTOR": TTFT_LAT_FACTOR, "SPLIT_TOP": SPLIT_TOP, "MAX_SPLIT_CAP": MAX_SPLIT_CAP}


cdef inline double _leg_bytes(double la, double lb, double lk, double lr, double t,
                              double chunk) noexcept nogil:
    """Bytes a split leg (fixed latency la, bytes/us lb, chunk breakpoint lk, relay count lr)
    delivers by time t (us): the inverse of its finish time la + (1 + r) * s / b for s <= chunk
    (the whole share is one pipeline chunk) and la + r * chunk / b + s / b above it; 0 before its
    fixed latency la has passed."""
    if t <= la:
        return 0.0
    if t <= lk:
        return (t - la) * lb / (1.0 + lr)
    return (t - la) * lb - lr * chunk


@cython.final
cdef class PairCore:
    def __cinit__(self, int[::1] ptype, int[::1] ptr, int[::1] plinks, double[::1] fixed_lat,
                  int[::1] nrelay, double[::1] extra_hops, unsigned char[::1] disjoint,
                  double[::1] cap, double[::1] thr, double[::1] util, double[::1] qdelay,
                  double[::1] params):
        cdef int n = ptype.shape[0]
        if ptr.shape[0] != n + 1 or fixed_lat.shape[0] != n or nrelay.shape[0] != n \
                or extra_hops.shape[0] != n or disjoint.shape[0] != n * n:
            raise ValueError("PairCore: inconsistent candidate array sizes")
        if cap.shape[0] != thr.shape[0] or util.shape[0] != cap.shape[0] or qdelay.shape[0] != cap.shape[0]:
            raise ValueError("PairCore: inconsistent link array sizes")
        if params.shape[0] != P_NPARAMS:
            raise ValueError("PairCore: params must have %d entries" % P_NPARAMS)
        self.n_paths = n
        self.ptype, self.ptr, self.plinks = ptype, ptr, plinks
        self.fixed_lat, self.nrelay, self.extra_hops, self.disjoint = fixed_lat, nrelay, extra_hops, disjoint
        self.cap, self.thr, self.util, self.qdelay, self.params = cap, thr, util, qdelay, params
        cdef int m = n if n > 0 else 1
        self.s_bw = <double*>malloc(m * sizeof(double))
        self.s_cost = <double*>malloc(m * sizeof(double))
        self.s_est = <double*>malloc(m * sizeof(double))
        self.s_tl = <double*>malloc(m * sizeof(double))
        self.s_q = <double*>malloc(m * sizeof(double))
        self.s_risk = <double*>malloc(m * sizeof(double))
        self.s_rej = <int*>malloc(m * sizeof(int))
        self.s_worst = <int*>malloc(m * sizeof(int))
        self.s_order = <int*>malloc(m * sizeof(int))
        self.s_sel = <int*>malloc(MAX_SPLIT_CAP * sizeof(int))
        self.s_sh = <double*>malloc(MAX_SPLIT_CAP * sizeof(double))
        if not (self.s_bw and self.s_cost and self.s_est and self.s_tl and self.s_q and self.s_risk
                and self.s_rej and self.s_worst and self.s_order and self.s_sel and self.s_sh):
            raise MemoryError()

    def __dealloc__(self):
        free(self.s_bw); free(self.s_cost); free(self.s_est); free(self.s_tl); free(self.s_q)
        free(self.s_risk); free(self.s_rej); free(self.s_worst); free(self.s_order); free(self.s_sel)
        free(self.s_sh)

    def set_params(self, double[::1] params):
        if params.shape[0] != P_NPARAMS:
            raise ValueError("PairCore: params must have %d entries" % P_NPARAMS)
        self.params = params

    cdef void _score(self, double nbytes, bint ttft) noexcept nogil:
        # the arrays through local pointers: a memoryview's data is a char*, which may alias
        # anything, so every self.x[i] after a store reloaded the view from self (issue 15)
        cdef int p, k, l, worst, rej, k1
        cdef double bw, a, fl, u, r, risk, q, worst_ex, ex, t_x, t_f, t_l, hopf, wl, chunk, th, cp
        cdef const double* params = &self.params[0]
        cdef const double* util = &self.util[0]
        cdef const double* qdelay = &self.qdelay[0]
        cdef const double* cap = &self.cap[0]
        cdef const double* thr = &self.thr[0]
        cdef const int* plinks = &self.plinks[0] if self.plinks.shape[0] > 0 else NULL
        cdef const int* ptr = &self.ptr[0]
        cdef const int* nrelay = &self.nrelay[0] if self.n_paths > 0 else NULL
        cdef const double* fixed_lat = &self.fixed_lat[0] if self.n_paths > 0 else NULL
        cdef const double* extra_hops = &self.extra_hops[0] if self.n_paths > 0 else NULL
        cdef double w_bw = params[P_W_BW], w_q = params[P_W_Q], w_hops = params[P_W_HOPS]
        cdef double w_qos = params[P_W_QOS], w_lat = params[P_W_LAT]
        cdef double relay_chunk = params[P_RELAY_CHUNK], relay_ovh = params[P_RELAY_OVERHEAD_US]
        chunk = nbytes if nbytes < relay_chunk else relay_chunk
        hopf = TTFT_HOP_FACTOR if ttft else 1.0
        wl = w_lat * (TTFT_LAT_FACTOR if ttft else 1.0)
        for p in range(self.n_paths):
            bw = 1e300
            risk = 0.0
            q = 0.0
            worst = -1
            worst_ex = 0.0
            rej = 0
            k1 = ptr[p + 1]
            for k in range(ptr[p], k1):
                l = plinks[k]
                u = util[l]
                if u < 0.0:
                    u = 0.0
                if u > 1.0:
                    u = 1.0
                cp = cap[l]
                th = thr[l]
                a = cp * (1.0 - u)
                fl = cp * MIN_AVAIL_FRAC
                if a < fl:
                    a = fl
                if a < bw:
                    bw = a
                r = u / th
                if r > risk:
                    risk = r
                if u > th:
                    rej = 1
                    ex = u - th
                    if worst < 0 or ex > worst_ex:
                        worst_ex = ex
                        worst = l
                q = q + qdelay[l]
            if risk > 1.0:
                risk = 1.0
            t_x = nbytes / (bw * 1000.0)
            # per relay one pipeline chunk at the path's bandwidth (bytes moving: costed like t_x)
            t_f = nrelay[p] * (chunk / (bw * 1000.0))
            t_l = fixed_lat[p] + nrelay[p] * (chunk / (bw * 1000.0) + relay_ovh)
            self.s_rej[p] = rej
            self.s_bw[p] = bw
            self.s_tl[p] = t_l
            self.s_q[p] = q
            self.s_risk[p] = risk
            self.s_worst[p] = worst
            self.s_est[p] = t_x + t_l + q
            self.s_cost[p] = (w_bw * (t_x + t_f) + wl * (fixed_lat[p] + nrelay[p] * relay_ovh)
                              + w_q * q) * (1.0 + w_hops * extra_hops[p] * hopf) \
                * (1.0 + w_qos * risk)

    cdef double _set_cost(self, int* sel, int n, double nbytes, bint ttft, double* est_out,
                          double* bw_out) noexcept nogil:
        """Cost of splitting over the n paths in sel with shares that make every leg finish at the
        same time T (left in s_sh); est_out = T. Each leg costs like a single path carrying its
        share: fixed latency, queueing, and per relay one pipeline chunk of min(share, relay_chunk)
        plus the hand-off. Returns -1.0 when a leg would carry less than one byte (its fixed
        latency is not below T): that set is no split. The per-leg scratch (la, lb, lk, lr: the
        twin's s_la, s_lb, s_lk, s_lr) lives on the stack and the arrays are read through local
        pointers (issue 15: same operations, in the same order)."""
        cdef int i, j, p
        cdef const double* params = &self.params[0]
        cdef const double* fixed_lat = &self.fixed_lat[0]
        cdef const double* extra_hops = &self.extra_hops[0]
        cdef const int* nrelay = &self.nrelay[0]
        cdef double* s_bw = self.s_bw
        cdef double* s_q = self.s_q
        cdef double* s_risk = self.s_risk
        cdef double la[8]
        cdef double lb[8]
        cdef double lk[8]
        cdef double lr[8]
        cdef double chunk = params[P_RELAY_CHUNK], relay_ovh = params[P_RELAY_OVERHEAD_US]
        cdef double bws = 0.0, risk = 0.0, b, r, a, tb, sb, bp, s, slope, t_end
        cdef double sh, c, leg, acc, hopf, wl, w_bw, w_q, w_hops
        for i in range(n):
            p = sel[i]
            b = s_bw[p] * 1000.0
            r = <double>nrelay[p]
            a = fixed_lat[p] + r * relay_ovh + s_q[p]
            lb[i] = b
            lr[i] = r
            la[i] = a
            lk[i] = a + (1.0 + r) * chunk / b
            bws = bws + s_bw[p]
            if s_risk[p] > risk:
                risk = s_risk[p]
        # T: the latest breakpoint (a leg starts, or its share outgrows one chunk) by which fewer
        # than nbytes are delivered, plus the rest at the summed slope of the legs there
        tb = -1.0
        sb = 0.0
        for j in range(2 * n):
            bp = la[j >> 1] if (j & 1) == 0 else lk[j >> 1]
            if tb >= 0.0 and bp <= tb:
                continue
            s = 0.0
            for i in range(n):
                s = s + _leg_bytes(la[i], lb[i], lk[i], lr[i], bp, chunk)
            if s <= nbytes:
                tb = bp
                sb = s
        slope = 0.0
        for i in range(n):
            if tb >= la[i]:
                if tb < lk[i]:
                    slope = slope + lb[i] / (1.0 + lr[i])
                else:
                    slope = slope + lb[i]
        t_end = tb + (nbytes - sb) / slope
        est_out[0] = t_end
        bw_out[0] = bws
        # the cost: each leg's single-path cost for its own share (transfer, latency and queueing
        # terms, its own hop penalty), weighted by its bytes; QoS risk of the riskiest leg
        hopf = TTFT_HOP_FACTOR if ttft else 1.0
        wl = params[P_W_LAT] * (TTFT_LAT_FACTOR if ttft else 1.0)
        w_bw = params[P_W_BW]
        w_q = params[P_W_Q]
        w_hops = params[P_W_HOPS]
        acc = 0.0
        for i in range(n):
            p = sel[i]
            sh = _leg_bytes(la[i], lb[i], lk[i], lr[i], t_end, chunk)
            if sh < 1.0:
                return -1.0
            self.s_sh[i] = sh
            c = sh if sh < chunk else chunk
            leg = (w_bw * (sh / lb[i] + lr[i] * (c / lb[i]))
                   + wl * (fixed_lat[p] + lr[i] * relay_ovh)
                   + w_q * s_q[p]) * (1.0 + w_hops * extra_hops[p] * hopf)
            acc = acc + sh * leg
        return acc / nbytes * (1.0 + params[P_W_QOS] * risk)

    cdef inline double _pair_bound(self, int a, int b, double nbytes, bint ttft) noexcept nogil:
        """A lower bound of _set_cost for the two legs a, b (weights are >= 0): the transfer term
        at best (shares proportional to bandwidth: w_bw * nbytes / (bw_a + bw_b)) plus the smaller
        leg's latency and queueing terms, hop penalties and relay fill dropped, times the riskier
        leg's QoS factor. The 1e-9 slack at the call site covers rounding, so pruning with it never
        changes a decision."""
        cdef double wl = self.params[P_W_LAT] * (TTFT_LAT_FACTOR if ttft else 1.0)
        cdef double ovh = self.params[P_RELAY_OVERHEAD_US], w_q = self.params[P_W_Q]
        cdef double fa = wl * (self.fixed_lat[a] + self.nrelay[a] * ovh) + w_q * self.s_q[a]
        cdef double fb = wl * (self.fixed_lat[b] + self.nrelay[b] * ovh) + w_q * self.s_q[b]
        cdef double risk = self.s_risk[a] if self.s_risk[a] > self.s_risk[b] else self.s_risk[b]
        if fb < fa:
            fa = fb
        return (self.params[P_W_BW] * nbytes / ((self.s_bw[a] + self.s_bw[b]) * 1000.0) + fa) \
            * (1.0 + self.params[P_W_QOS] * risk)

    cdef bint _disjoint_with(self, int c, int* sel, int n) noexcept nogil:
        cdef int i
        for i in range(n):
            if self.disjoint[c * self.n_paths + sel[i]] == 0:
                return False
        return True

    def select(self, double nbytes, bint ttft):
        """-> (kind, indices, shares, est_bw_gbps, est_time_us, qos_violation, reason, aux_link, aux_path, gain, cost):
        cost_model.CoreResult's layout as a plain tuple (None without candidates)"""
        cdef Result r
        if not self._run(nbytes, ttft, &r):
            return None
        return _result_tuple(&r)

    def decide(self, request, paths, selector, bint ttft_default, type cls):
        """select() for `request` wrapped into a `cls` decision (a DecisionBase subclass) for
        `request`, `paths`, `selector`: PathSelector.select minus its table lookup."""
        if not PyType_IsSubtype(cls, DecisionBase):
            raise TypeError("PairCore.decide: cls must be a DecisionBase subclass")
        cdef bint ttft = request.ttft_sensitive or ttft_default
        return _decision(self, cls, request, paths, selector, <double>request.data_bytes, ttft)

    cdef bint _run(self, double nbytes, bint ttft, Result* res) noexcept nogil:
        """Scores, rules and split search for one request; the result in *res (laid out as
        cost_model.CoreResult, see _result_tuple). False without candidates. No Python objects:
        the caller allocates what it returns before, so nothing can run between the scoring and
        the copy of its result (issue 15: the 11-item tuple, its floats and share ints were
        ~0.15 us of every select; they are built on first access of PathDecision._raw)."""
        cdef int n = self.n_paths, p, i, j, best_dir = -1, best_ok = -1, best_all = -1, choose
        cdef int kind, reason = 0, aux_link = -1, aux_path = -1, qos_flag = 0, n_top = 0, nsel = 0
        cdef int max_split, c, best_c, t
        cdef double gain = 0.0, sgain = 0.0, cost, est, bw, c2, e2, b2, best_pair_cost, best_pair_est, best_pair_bw
        cdef double cur_cost, cur_est, cur_bw, cand_cost, cand_est, cand_bw, best_bw, sh0 = 0.0, sh1 = 0.0
        cdef long long rem, s0
        cdef int pair[8]
        cdef int trial[8]
        res.nbytes = nbytes
        if n == 0:
            return False
        # runs with the GIL held: releasing it for ~0.5 us invites a thread switch that
        # costs far more (the loops are nogil-capable if a caller ever needs that)
        self._score(nbytes, ttft)
        for p in range(n):
            if best_all < 0 or self.s_cost[p] < self.s_cost[best_all]:
                best_all = p
            if self.s_rej[p] == 0:
                if best_ok < 0 or self.s_cost[p] < self.s_cost[best_ok]:
                    best_ok = p
                if self.ptype[p] == PT_DIRECT and (best_dir < 0 or self.s_cost[p] < self.s_cost[best_dir]):
                    best_dir = p
        if best_ok < 0:
            choose = best_all
            res.kind = self.ptype[choose]
            res.n = 1
            res.idx[0] = choose
            res.bw = self.s_bw[choose]
            res.est = self.s_est[choose]
            res.qos = True
            res.reason = 4
            res.aux_link = self.s_worst[choose]
            res.aux_util = self.util[res.aux_link] if res.aux_link >= 0 else 0.0
            res.aux_path = choose
            res.gain = 0.0
            res.cost = self.s_cost[choose]
            return True
        choose = best_ok
        if self.ptype[choose] != PT_DIRECT:
            if best_dir >= 0:
                gain = self.s_cost[best_dir] / self.s_cost[choose] - 1.0
                if gain > self.params[P_RELAY_MARGIN]:
                    reason = 1
                    # explain by the default route when it is the one QoS rejected
                    for p in range(n):
                        if self.ptype[p] == PT_DIRECT:
                            if self.s_rej[p]:
                                reason = 6 if self.ptype[choose] == PT_STORAGE_RELAY else 2
                                aux_link = self.s_worst[p]
                            break
                else:
                    reason = 5
                    aux_path = choose
                    choose = best_dir
            else:
                reason = 6 if self.ptype[choose] == PT_STORAGE_RELAY else 2
                for p in range(n):
                    if self.ptype[p] == PT_DIRECT:
                        aux_link = self.s_worst[p]
                        break
        kind = self.ptype[choose]
        cost = self.s_cost[choose]
        est = self.s_est[choose]
        bw = self.s_bw[choose]
        max_split = <int>self.params[P_MAX_SPLIT]
        if max_split > MAX_SPLIT_CAP:
            max_split = MAX_SPLIT_CAP
        if self.params[P_ENABLE_SPLIT] != 0.0 and max_split >= 2:
            # runs with the GIL held: releasing it for ~0.5 us invites a thread switch that
            # costs far more (the loops are nogil-capable if a caller ever needs that)
            # feasible candidates by available bandwidth, widest first (ties: lower index)
            for t in range(n):
                self.s_rej[t] = self.s_rej[t] * 2  # 0 = feasible & not yet ordered; 2 = infeasible
            while n_top < SPLIT_TOP:
                best_c = -1
                best_bw = 0.0
                for p in range(n):
                    if self.s_rej[p] == 0 and (best_c < 0 or self.s_bw[p] > best_bw):
                        best_c = p
                        best_bw = self.s_bw[p]
                if best_c < 0:
                    break
                self.s_rej[best_c] = -1 - n_top  # < 0: among the widest, at rank -1 - s_rej
                self.s_order[n_top] = best_c
                n_top += 1
            best_pair_cost = -1.0
            best_pair_est = 0.0
            best_pair_bw = 0.0
            # first leg among the widest feasible candidates, its partner among ALL feasible
            # ones (on clusters many rails tie on bandwidth and the disjoint partner is far down)
            for i in range(n_top):
                for j in range(n):
                    if j == self.s_order[i] or self.s_rej[j] == 2:
                        continue
                    # a two-leg cost is symmetric bit for bit (every sum has two terms), so the
                    # pair (j, i) costed when j was the first leg can never lose to (i, j) under
                    # the strict '<' below: skip it (halves the pair costings; issue 15)
                    if self.s_rej[j] < 0 and -1 - self.s_rej[j] < i:
                        continue
                    if self.disjoint[self.s_order[i] * n + j] == 0:
                        continue
                    if best_pair_cost >= 0.0 and self._pair_bound(self.s_order[i], j, nbytes, ttft) \
                            * (1.0 - 1e-9) > best_pair_cost:
                        continue  # cannot beat the best pair so far: skip the exact costing
                    trial[0] = self.s_order[i]
                    trial[1] = j
                    c2 = self._set_cost(trial, 2, nbytes, ttft, &e2, &b2)
                    if c2 >= 0.0 and (best_pair_cost < 0.0 or c2 < best_pair_cost):
                        best_pair_cost = c2
                        best_pair_est = e2
                        best_pair_bw = b2
                        pair[0] = trial[0]
                        pair[1] = trial[1]
                        sh0 = self.s_sh[0]  # its equal-finish shares: no re-costing if it stays a pair
                        sh1 = self.s_sh[1]
            if best_pair_cost >= 0.0:
                nsel = 2
                cur_cost, cur_est, cur_bw = best_pair_cost, best_pair_est, best_pair_bw
                while nsel < max_split:
                    best_c = -1
                    for c in range(n):
                        if self.s_rej[c] == 2:
                            continue
                        if not self._disjoint_with(c, pair, nsel):
                            continue
                        pair[nsel] = c
                        cand_cost = self._set_cost(pair, nsel + 1, nbytes, ttft, &cand_est, &cand_bw)
                        if cand_cost >= 0.0 and cand_cost < cur_cost:
                            cur_cost, cur_est, cur_bw = cand_cost, cand_est, cand_bw
                            best_c = c
                    if best_c < 0:
                        break
                    pair[nsel] = best_c
                    nsel += 1
            if nsel >= 2:
                sgain = cost / cur_cost - 1.0
                if sgain > self.params[P_SPLIT_MARGIN]:
                    if nsel == 2:
                        self.s_sh[0] = sh0
                        self.s_sh[1] = sh1
                    else:
                        self._set_cost(pair, nsel, nbytes, ttft, &e2, &b2)  # the chosen set's equal-finish shares
                    # whole bytes, truncated as Python's int() does (shares < 2**53), the last
                    # takes the remainder
                    rem = <long long>nbytes
                    for i in range(nsel - 1):
                        s0 = <long long>self.s_sh[i]
                        res.idx[i] = pair[i]
                        res.sh[i] = s0
                        rem -= s0
                    res.idx[nsel - 1] = pair[nsel - 1]
                    res.sh[nsel - 1] = rem
                    res.kind = PT_SPLIT
                    res.n = nsel
                    res.bw = cur_bw
                    res.est = cur_est
                    res.qos = False
                    res.reason = 3
                    res.aux_link = -1
                    res.aux_util = 0.0
                    res.aux_path = -1
                    res.gain = sgain
                    res.cost = cur_cost
                    return True
        if reason == 0:
            gain = 0.0
        res.kind = kind
        res.n = 1
        res.idx[0] = choose
        res.bw = bw
        res.est = est
        res.qos = False
        res.reason = reason
        res.aux_link = aux_link
        res.aux_util = self.util[aux_link] if aux_link >= 0 else 0.0
        res.aux_path = aux_path
        res.gain = gain
        res.cost = cost
        return True

    def scores(self, double nbytes, bint ttft):
        """Per-candidate (available_bw, est_time_us, cost, rejected) for diagnostics and the CLI."""
        self._score(nbytes, ttft)
        return [(self.s_bw[p], self.s_est[p], self.s_cost[p], bool(self.s_rej[p])) for p in range(self.n_paths)]


cdef tuple _result_tuple(Result* r):
    """*r as cost_model.CoreResult's layout, a plain tuple (a NamedTuple costs a Python call):
    (kind, indices, shares, est_bw_gbps, est_time_us, qos_violation, reason, aux_link, aux_path, gain, cost,
    aux_util)"""
    cdef int i
    if r.n == 1:
        idx = (r.idx[0],)
        shares = (int(r.nbytes),)
    elif r.n == 2:
        idx = (r.idx[0], r.idx[1])
        shares = (r.sh[0], r.sh[1])
    else:
        idx = tuple([r.idx[i] for i in range(r.n)])
        shares = tuple([r.sh[i] for i in range(r.n)])
    return (r.kind, idx, shares, r.bw, r.est, True if r.qos else False, r.reason, r.aux_link, r.aux_path,
            r.gain, r.cost, r.aux_util)


cdef class DecisionBase:
    """Storage of selector.types.PathDecision. Built by the compiled select() in C with the core's
    result as a C struct; `_raw` (the CoreResult-layout tuple) is made on first access (issue 15)."""
    cdef public object request, _paths, _sel, _reason
    cdef object _rawt
    cdef bint _built
    cdef Result res

    def __init__(self, request, paths, raw, selector):
        self.request = request
        self._paths = paths  # candidate Path tuple of the (src, dst) pair
        self._rawt = raw
        self._built = True
        self._sel = selector
        self._reason = None

    @property
    def _raw(self):
        """The core's result, laid out as cost_model.CoreResult (a plain tuple, or what __init__ got)."""
        if not self._built:
            self._rawt = _result_tuple(&self.res) if self.res.n > 0 else None
            self._built = True
        return self._rawt

    @_raw.setter
    def _raw(self, raw):
        self._rawt = raw
        self._built = True


cdef object _decision(PairCore core, type cls, object request, object paths, object selector,
                      double nbytes, bint ttft):
    """A `cls` (DecisionBase subclass) for request, without its __init__: the object is made first,
    then the core writes its result straight into it (nothing else allocates in between)."""
    # the type's tp_new without the type call machinery (args may be NULL: DecisionBase has no
    # __cinit__); the callers check cls is a DecisionBase subclass
    cdef DecisionBase d = <DecisionBase>(<PyTypeObject*>cls).tp_new(cls, NULL, NULL)
    # runs with the GIL held: releasing it for ~0.5 us invites a thread switch that costs far
    # more (_run is nogil-capable if a caller ever needs that)
    core._run(nbytes, ttft, &d.res)
    d.request = request
    d._paths = paths
    d._sel = selector
    d._reason = None
    return d


@cython.final
cdef class _Pair:
    cdef object core, paths
    cdef bint compiled


@cython.final
cdef class Dispatch:
    """PathSelector.select as one C call (installed as the selector's `select` attribute when the
    compiled core is in use): the pair lookup, the request's fields, the core and the decision
    object without a Python frame. `build(src, dst)` returns the selector's _PairTable on a miss.
    Pairs are looked up src, then dst (two dict lookups on interned str keys are cheaper than
    building and hashing a (src, dst) tuple)."""
    cdef dict fast
    cdef object build, selector
    cdef type cls
    cdef public bint ttft_default

    def __init__(self, build, selector, type cls, bint ttft_default):
        if not PyType_IsSubtype(cls, DecisionBase):
            raise TypeError("Dispatch: cls must be a DecisionBase subclass")
        self.fast = {}
        self.build = build
        self.selector = selector
        self.cls = cls
        self.ttft_default = ttft_default

    cdef _Pair _miss(self, src, dst):
        t = self.build(src, dst)
        cdef _Pair e = _Pair.__new__(_Pair)
        e.core = t.core
        e.paths = t.paths
        e.compiled = type(t.core) is PairCore
        inner = self.fast.get(src)
        if inner is None:
            inner = self.fast[src] = {}
        inner[dst] = e
        return e

    def __call__(self, request):
        return self.select(request)

    def select(self, request):
        """PathSelector.select(request): PathSelector installs this bound method as its `select`
        (a bound method of a compiled class is called without building an argument tuple)."""
        cdef object src = request.src, dst = request.dst
        cdef PyObject* inner = PyDict_GetItem(self.fast, src)
        cdef PyObject* ent = NULL
        cdef _Pair e
        if inner is not NULL:
            ent = PyDict_GetItem(<object>inner, dst)
        if ent is NULL:
            e = self._miss(src, dst)
        else:
            e = <_Pair>ent
        cdef bint ttft = request.ttft_sensitive or self.ttft_default
        if e.compiled:
            return _decision(<PairCore>e.core, self.cls, request, e.paths, self.selector,
                             <double>request.data_bytes, ttft)
        # a core of another build (benchmarks' baseline): its Python method
        return self.cls(request, e.paths, e.core.select(request.data_bytes, ttft), self.selector)
