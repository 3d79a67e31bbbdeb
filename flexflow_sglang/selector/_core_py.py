"""Pure-Python twin of csrc/flexflow_sglang/_selector_core.pyx.

Same operations in the same order on IEEE doubles, so it returns exactly the results the compiled
core returns (tests/selector/test_twin.py checks thousands of random cases): laid out as
cost_model.CoreResult, which the twin builds and the compiled core returns as a plain tuple (they
compare equal). It is the fallback when the extension is not built, and the reference the compiled
core is measured against.
"""

# the cost model's constants and the params layout: one definition, in cost_model.py (the compiled
# core's typed copies are checked against it by tests/selector/test_cost_model.py)
from .cost_model import (MAX_SPLIT_CAP, MIN_AVAIL_FRAC, P_ENABLE_SPLIT, P_MAX_SPLIT, P_NPARAMS,
                         P_RELAY_CHUNK, P_RELAY_MARGIN, P_RELAY_OVERHEAD_US, P_SPLIT_MARGIN, P_W_BW, P_W_HOPS,
                         P_W_LAT, P_W_Q, P_W_QOS, SPLIT_TOP, TTFT_HOP_FACTOR, TTFT_LAT_FACTOR, CoreResult)

PT_DIRECT, PT_NVLINK_RELAY, PT_CROSSNODE_RELAY, PT_SPLIT, PT_STORAGE_RELAY = 0, 1, 2, 3, 4


class PairCore:
    #: True: cost every ordered pair and re-cost the chosen split (the search before issue 15);
    #: tests/selector/test_twin.py checks the pruned search decides exactly like it
    EXHAUSTIVE = False

    def __init__(self, ptype, ptr, plinks, fixed_lat, nrelay, extra_hops, disjoint, cap, thr, util,
                 qdelay, params):
        n = len(ptype)
        if len(ptr) != n + 1 or len(fixed_lat) != n or len(nrelay) != n or len(extra_hops) != n \
                or len(disjoint) != n * n:
            raise ValueError("PairCore: inconsistent candidate array sizes")
        if len(cap) != len(thr) or len(util) != len(cap) or len(qdelay) != len(cap):
            raise ValueError("PairCore: inconsistent link array sizes")
        if len(params) != P_NPARAMS:
            raise ValueError("PairCore: params must have %d entries" % P_NPARAMS)
        self.n_paths = n
        self.ptype = [int(x) for x in ptype]
        self.ptr = [int(x) for x in ptr]
        self.plinks = [int(x) for x in plinks]
        self.fixed_lat = [float(x) for x in fixed_lat]
        self.nrelay = [int(x) for x in nrelay]
        self.extra_hops = [float(x) for x in extra_hops]
        self.disjoint = [int(x) for x in disjoint]
        self.cap = [float(x) for x in cap]
        self.thr = [float(x) for x in thr]
        self.util = util  # live arrays owned by the NodeAgent, read element by element
        self.qdelay = qdelay
        self.params = params
        m = max(n, 1)
        self.s_bw = [0.0] * m
        self.s_cost = [0.0] * m
        self.s_est = [0.0] * m
        self.s_tl = [0.0] * m
        self.s_q = [0.0] * m
        self.s_risk = [0.0] * m
        self.s_rej = [0] * m
        self.s_worst = [0] * m
        self.s_order = [0] * m
        # per-leg scratch of the split being costed: fixed latency, bytes/us, chunk breakpoint,
        # relay count, share
        self.s_la = [0.0] * MAX_SPLIT_CAP
        self.s_lb = [0.0] * MAX_SPLIT_CAP
        self.s_lk = [0.0] * MAX_SPLIT_CAP
        self.s_lr = [0.0] * MAX_SPLIT_CAP
        self.s_sh = [0.0] * MAX_SPLIT_CAP

    def set_params(self, params):
        if len(params) != P_NPARAMS:
            raise ValueError("PairCore: params must have %d entries" % P_NPARAMS)
        self.params = params

    def _score(self, nbytes, ttft):
        params = self.params
        w_bw, w_q, w_hops = float(params[P_W_BW]), float(params[P_W_Q]), float(params[P_W_HOPS])
        w_qos, w_lat = float(params[P_W_QOS]), float(params[P_W_LAT])
        relay_chunk, relay_ovh = float(params[P_RELAY_CHUNK]), float(params[P_RELAY_OVERHEAD_US])
        chunk = nbytes if nbytes < relay_chunk else relay_chunk
        hopf = TTFT_HOP_FACTOR if ttft else 1.0
        wl = w_lat * (TTFT_LAT_FACTOR if ttft else 1.0)
        util, qdelay, cap, thr, plinks = self.util, self.qdelay, self.cap, self.thr, self.plinks
        for p in range(self.n_paths):
            bw = 1e300
            risk = 0.0
            q = 0.0
            worst = -1
            worst_ex = 0.0
            self.s_rej[p] = 0
            for k in range(self.ptr[p], self.ptr[p + 1]):
                l = plinks[k]
                u = float(util[l])
                if u < 0.0:
                    u = 0.0
                if u > 1.0:
                    u = 1.0
                a = cap[l] * (1.0 - u)
                fl = cap[l] * MIN_AVAIL_FRAC
                if a < fl:
                    a = fl
                if a < bw:
                    bw = a
                r = u / thr[l]
                if r > risk:
                    risk = r
                if u > thr[l]:
                    self.s_rej[p] = 1
                    ex = u - thr[l]
                    if worst < 0 or ex > worst_ex:
                        worst_ex = ex
                        worst = l
                q = q + float(qdelay[l])
            if risk > 1.0:
                risk = 1.0
            t_x = nbytes / (bw * 1000.0)
            # per relay one pipeline chunk at the path's bandwidth (bytes moving: costed like t_x)
            t_f = self.nrelay[p] * (chunk / (bw * 1000.0))
            t_l = self.fixed_lat[p] + self.nrelay[p] * (chunk / (bw * 1000.0) + relay_ovh)
            self.s_bw[p] = bw
            self.s_tl[p] = t_l
            self.s_q[p] = q
            self.s_risk[p] = risk
            self.s_worst[p] = worst
            self.s_est[p] = t_x + t_l + q
            self.s_cost[p] = (w_bw * (t_x + t_f) + wl * (self.fixed_lat[p] + self.nrelay[p] * relay_ovh)
                              + w_q * q) * (1.0 + w_hops * self.extra_hops[p] * hopf) \
                * (1.0 + w_qos * risk)

    def _leg_bytes(self, i, t, chunk):
        """Bytes leg i of the split being costed delivers by time t (us): the inverse of its finish
        time la + (1 + r) * s / b for s <= chunk (the whole share is one pipeline chunk) and
        la + r * chunk / b + s / b above it; 0 before its fixed latency la has passed."""
        la = self.s_la[i]
        if t <= la:
            return 0.0
        if t <= self.s_lk[i]:
            return (t - la) * self.s_lb[i] / (1.0 + self.s_lr[i])
        return (t - la) * self.s_lb[i] - self.s_lr[i] * chunk

    def _set_cost(self, sel, n, nbytes, ttft):
        """Cost, estimated time and summed bandwidth of splitting over the n paths in sel, with
        shares that make every leg finish at the same time T (left in s_sh). Each leg costs like a
        single path carrying its share: fixed latency, queueing, and per relay one pipeline chunk
        of min(share, relay_chunk) plus the hand-off. Returns cost -1.0 when a leg would carry
        less than one byte (its fixed latency is not below T): that set is no split."""
        params = self.params
        chunk, relay_ovh = float(params[P_RELAY_CHUNK]), float(params[P_RELAY_OVERHEAD_US])
        bws = 0.0
        risk = 0.0
        la, lb, lk, lr = self.s_la, self.s_lb, self.s_lk, self.s_lr
        for i in range(n):
            p = sel[i]
            b = self.s_bw[p] * 1000.0
            r = float(self.nrelay[p])
            a = self.fixed_lat[p] + r * relay_ovh + self.s_q[p]
            lb[i] = b
            lr[i] = r
            la[i] = a
            lk[i] = a + (1.0 + r) * chunk / b
            bws = bws + self.s_bw[p]
            if self.s_risk[p] > risk:
                risk = self.s_risk[p]
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
                s = s + self._leg_bytes(i, bp, chunk)
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
        # the cost: each leg's single-path cost for its own share (transfer, latency and queueing
        # terms, its own hop penalty), weighted by its bytes; QoS risk of the riskiest leg
        hopf = TTFT_HOP_FACTOR if ttft else 1.0
        wl = float(params[P_W_LAT]) * (TTFT_LAT_FACTOR if ttft else 1.0)
        w_bw, w_q, w_hops = float(params[P_W_BW]), float(params[P_W_Q]), float(params[P_W_HOPS])
        acc = 0.0
        for i in range(n):
            p = sel[i]
            sh = self._leg_bytes(i, t_end, chunk)
            if sh < 1.0:
                return -1.0, t_end, bws
            self.s_sh[i] = sh
            c = sh if sh < chunk else chunk
            leg = (w_bw * (sh / lb[i] + lr[i] * (c / lb[i])) + wl * (self.fixed_lat[p] + lr[i] * relay_ovh)
                   + w_q * self.s_q[p]) * (1.0 + w_hops * self.extra_hops[p] * hopf)
            acc = acc + sh * leg
        cost = acc / nbytes * (1.0 + float(params[P_W_QOS]) * risk)
        return cost, t_end, bws

    def _pair_bound(self, a, b, nbytes, ttft):
        params = self.params
        wl = float(params[P_W_LAT]) * (TTFT_LAT_FACTOR if ttft else 1.0)
        ovh = float(params[P_RELAY_OVERHEAD_US])
        w_q = float(params[P_W_Q])
        fa = wl * (self.fixed_lat[a] + self.nrelay[a] * ovh) + w_q * self.s_q[a]
        fb = wl * (self.fixed_lat[b] + self.nrelay[b] * ovh) + w_q * self.s_q[b]
        risk = self.s_risk[a] if self.s_risk[a] > self.s_risk[b] else self.s_risk[b]
        if fb < fa:
            fa = fb
        return (float(params[P_W_BW]) * nbytes / ((self.s_bw[a] + self.s_bw[b]) * 1000.0) + fa) \
            * (1.0 + float(params[P_W_QOS]) * risk)

    def _disjoint_with(self, c, sel, n):
        for i in range(n):
            if self.disjoint[c * self.n_paths + sel[i]] == 0:
                return False
        return True

    def _util_of(self, link):
        return float(self.util[link]) if link >= 0 else 0.0

    def decide(self, request, paths, selector, ttft_default, cls):
        return cls(request, paths, self.select(request.data_bytes, request.ttft_sensitive or ttft_default),
                   selector)

    def select(self, nbytes, ttft):
        nbytes = float(nbytes)
        ttft = bool(ttft)
        n = self.n_paths
        if n == 0:
            return None
        best_dir = best_ok = best_all = -1
        reason, aux_link, aux_path, gain, sgain = 0, -1, -1, 0.0, 0.0
        self._score(nbytes, ttft)
        s_cost, s_rej, ptype = self.s_cost, self.s_rej, self.ptype
        for p in range(n):
            if best_all < 0 or s_cost[p] < s_cost[best_all]:
                best_all = p
            if s_rej[p] == 0:
                if best_ok < 0 or s_cost[p] < s_cost[best_ok]:
                    best_ok = p
                if ptype[p] == PT_DIRECT and (best_dir < 0 or s_cost[p] < s_cost[best_dir]):
                    best_dir = p
        if best_ok < 0:
            choose = best_all
            worst = self.s_worst[choose]
            return CoreResult(ptype[choose], (choose,), (int(nbytes),), self.s_bw[choose], self.s_est[choose], True,
                              4, worst, choose, 0.0, s_cost[choose], self._util_of(worst))
        choose = best_ok
        params = self.params
        if ptype[choose] != PT_DIRECT:
            if best_dir >= 0:
                gain = s_cost[best_dir] / s_cost[choose] - 1.0
                if gain > float(params[P_RELAY_MARGIN]):
                    reason = 1
                    # explain by the default route when it is the one QoS rejected
                    for p in range(n):
                        if ptype[p] == PT_DIRECT:
                            if s_rej[p]:
                                reason = 6 if ptype[choose] == PT_STORAGE_RELAY else 2
                                aux_link = self.s_worst[p]
                            break
                else:
                    reason = 5
                    aux_path = choose
                    choose = best_dir
            else:
                reason = 6 if ptype[choose] == PT_STORAGE_RELAY else 2
                for p in range(n):
                    if ptype[p] == PT_DIRECT:
                        aux_link = self.s_worst[p]
                        break
        kind = ptype[choose]
        cost = s_cost[choose]
        est = self.s_est[choose]
        bw = self.s_bw[choose]
        max_split = int(float(params[P_MAX_SPLIT]))
        if max_split > MAX_SPLIT_CAP:
            max_split = MAX_SPLIT_CAP
        nsel = 0
        if float(params[P_ENABLE_SPLIT]) != 0.0 and max_split >= 2:
            for t in range(n):
                s_rej[t] = s_rej[t] * 2
            n_top = 0
            order = self.s_order
            while n_top < SPLIT_TOP:
                best_c = -1
                best_bw = 0.0
                for p in range(n):
                    if s_rej[p] == 0 and (best_c < 0 or self.s_bw[p] > best_bw):
                        best_c = p
                        best_bw = self.s_bw[p]
                if best_c < 0:
                    break
                s_rej[best_c] = -1 - n_top  # < 0: among the widest, at rank -1 - s_rej
                order[n_top] = best_c
                n_top += 1
            best_pair_cost = -1.0
            best_pair_est = 0.0
            best_pair_bw = 0.0
            pair = [0] * MAX_SPLIT_CAP
            # first leg among the widest feasible candidates, its partner among ALL feasible
            # ones (on clusters many rails tie on bandwidth and the disjoint partner is far down)
            for i in range(n_top):
                for j in range(n):
                    if j == order[i] or s_rej[j] == 2:
                        continue
                    if s_rej[j] < 0 and -1 - s_rej[j] < i and not self.EXHAUSTIVE:  # (j, i) costed, same cost
                        continue
                    if self.disjoint[order[i] * n + j] == 0:
                        continue
                    if best_pair_cost >= 0.0 and not self.EXHAUSTIVE and \
                            self._pair_bound(order[i], j, nbytes, ttft) * (1.0 - 1e-9) > best_pair_cost:
                        continue
                    trial = (order[i], j)
                    c2, e2, b2 = self._set_cost(trial, 2, nbytes, ttft)
                    if c2 >= 0.0 and (best_pair_cost < 0.0 or c2 < best_pair_cost):
                        best_pair_cost, best_pair_est, best_pair_bw = c2, e2, b2
                        pair[0], pair[1] = trial
                        sh0, sh1 = self.s_sh[0], self.s_sh[1]
            if best_pair_cost >= 0.0:
                nsel = 2
                cur_cost, cur_est, cur_bw = best_pair_cost, best_pair_est, best_pair_bw
                while nsel < max_split:
                    best_c = -1
                    for c in range(n):
                        if s_rej[c] == 2:
                            continue
                        if not self._disjoint_with(c, pair, nsel):
                            continue
                        pair[nsel] = c
                        cand_cost, cand_est, cand_bw = self._set_cost(pair, nsel + 1, nbytes, ttft)
                        if cand_cost >= 0.0 and cand_cost < cur_cost:
                            cur_cost, cur_est, cur_bw = cand_cost, cand_est, cand_bw
                            best_c = c
                    if best_c < 0:
                        break
                    pair[nsel] = best_c
                    nsel += 1
            if nsel >= 2:
                sgain = cost / cur_cost - 1.0
                if sgain > float(params[P_SPLIT_MARGIN]):
                    idx = tuple(pair[i] for i in range(nsel))
                    if nsel == 2 and not self.EXHAUSTIVE:  # the best pair's shares, kept when costed
                        self.s_sh[0], self.s_sh[1] = sh0, sh1
                    else:
                        self._set_cost(pair, nsel, nbytes, ttft)  # the chosen set's equal-finish shares
                    shares = []
                    rem = int(nbytes)
                    for i in range(nsel - 1):
                        s = int(self.s_sh[i])
                        shares.append(s)
                        rem -= s
                    shares.append(rem)
                    return CoreResult(PT_SPLIT, idx, tuple(shares), cur_bw, cur_est, False, 3, -1, -1, sgain, cur_cost, 0.0)
        if reason == 0:
            gain = 0.0
        return CoreResult(kind, (choose,), (int(nbytes),), bw, est, False, reason, aux_link, aux_path, gain, cost,
                          self._util_of(aux_link))

    def scores(self, nbytes, ttft):
        self._score(float(nbytes), bool(ttft))
        return [(self.s_bw[p], self.s_est[p], self.s_cost[p], bool(self.s_rej[p])) for p in range(self.n_paths)]
