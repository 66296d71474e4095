"""Live-pair scheduling with ZigZag (BlitzScale §5.2, Fig. 15, ILP (1), Fig. 16).

A *live pair* is an overloaded instance (the source, inst.0, which holds every
layer) and a loading instance (the target, inst.1, which receives layers one
after another).  Each queued batch i runs its first T_i layers on the target
and the remaining S_i = L - T_i on the source; ZigZag picks (T_i, S_i) so that
batches wait for layers that are about to arrive instead of piling up on the
source.

Time model shared by every function here (BlitzScale §5.2's, in units of one
layer computation of one batch):

* t = 0 is when the target has loaded layer 1 ("execution starts when the first
  layer has been loaded"); layer m (1-based) is usable from (m-1)·load_time.
* All batches are queued at t = 0 in FCFS order; every layer of every batch
  costs 1 unit on either instance; activation hand-off is free.
* The target runs one layer at a time and always picks the earliest batch whose
  next layer is loaded (Fig. 16's priority) — that is what makes it zigzag
  back to earlier batches when a new layer lands.
* The source runs batches strictly FCFS; batch i starts on it when the source
  is free and the target has finished batch i's T_i layers.
* A batch's latency is the time its last layer finishes.

Everything is pure except :class:`ZigZagQueue`, a deterministic state machine a
worker owns at run time (no I/O, no globals).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "live_pair_split",
    "zigzag_ilp",
    "best_effort_configs",
    "fixed_split_configs",
    "simulate_live_pair",
    "ZigZagQueue",
    "simulate_zigzag_queue",
    "ZigZagRun",
]

_EPS = 1e-9


def live_pair_split(loaded_blocks: int, n_blocks: int) -> int:
    """Blocks a loading target runs for its live pair before ZigZag takes over: all it has, up to half.

    The loading worker takes the first T blocks of each batch (it holds them already),
    the overloaded source the rest; capping T at half keeps the target, which is still
    receiving parameters, from becoming the bottleneck. 0 means no live pair yet.
    """
    if n_blocks < 2:
        raise ValueError(f"a live pair needs a model of at least 2 blocks, got {n_blocks}")
    if loaded_blocks < 0:
        raise ValueError(f"loaded_blocks must be >= 0, got {loaded_blocks}")
    return min(loaded_blocks, n_blocks // 2)


def _check(n_batches: int, n_layers: int, load_time_per_layer: float) -> None:
    if n_batches < 0:
        raise ValueError(f"n_batches must be >= 0, got {n_batches}")
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    if not load_time_per_layer >= 0 or math.isinf(load_time_per_layer):
        raise ValueError(f"load_time_per_layer must be finite and >= 0, got {load_time_per_layer}")


def _layers_loaded(t: float, n_layers: int, load_time: float) -> int:
    # Layer m is usable from (m-1)·load_time; layer 1 at t = 0.
    if load_time <= 0:
        return n_layers
    return min(n_layers, int(math.floor(t / load_time + _EPS)) + 1)


def _load_instant(layer: int, load_time: float) -> float:
    return (layer - 1) * load_time


# ---------------------------------------------------------------------------
# ILP (1)
# ---------------------------------------------------------------------------


def zigzag_ilp(
    n_batches: int, n_layers: int, load_time_per_layer: float, *, paper_c3: bool = True
) -> list[tuple[int, int]]:
    """Pipeline configurations (T_i, S_i) from BlitzScale's ILP (1).

    Objective (paper): minimise Σ_req Σ_{i≤req} S_i, the sum of FCFS latencies
    when the source never idles (batch i finishes at Σ_{j≤i} S_j).

    Constraints:

    * C1  S_i + T_i = L (substituted), with T_i ≤ L-1 so the source always
      finishes a batch and the latency formula holds.
    * C2  Σ_{j≤i} T_j ≤ Σ_{j<i} S_j for i > 1 (target done before the source
      starts batch i).
    * C3  Time_l·(T_i-1) ≤ Σ_{j<i} T_j + (N-i+1)·(T_i-1) for batches with
      T_i ≥ 1.  The paper prints Time_l·T_i on the left, measuring load time
      from the start of loading while the right side is measured from when
      layer 1 is loaded; read literally it forces T_1 ≥ Time_l and makes its
      own Fig. 15 example infeasible, so we use the same origin on both sides.
    * C3x (ours, tightening C3): the paper's C3 assumes every later batch
      interleaves T_i-1 layers, which can admit plans whose layers are not
      loaded in time.  For every batch i and layer m we require that the
      target work released at or after layer m's load instant and due by
      batch i's source start fits in between:
      Σ_{j≤i} max(0, T_j-m+1) ≤ Σ_{j<i} S_j - (m-1)·Time_l  whenever T_i ≥ m.
      With unit jobs this is exactly EDF feasibility, and Fig. 16's priority
      is EDF here, so :func:`simulate_live_pair` realises the ILP's latencies.
      (C2 is the m = 1 case; for i = 1 it forces T_1 = 0: the source starts
      the first batch at t = 0, as in the paper's "request 3 = 12 + 5" example.)

    Binaries y[i][m] = [T_i ≥ m] keep everything linear; a 7×7 instance
    solves in a few milliseconds with HiGHS, a dozen batches of a 32-layer
    model in about a second — beyond that use :class:`ZigZagQueue` (the
    paper's own answer for 80-layer models).

    ``paper_c3=False`` drops the printed C3 and keeps only the exact C3x: the
    true optimum of the time model.  The printed C3 is conservative for late
    batches (in Fig. 15 it caps batches 5-7 at three target layers), so the
    exact optimum can be better: 29 instead of 33 for the 7th batch there,
    which is also what the ILP-free queue reaches.
    """
    _check(n_batches, n_layers, load_time_per_layer)
    n, L, tl = n_batches, n_layers, float(load_time_per_layer)
    if n == 0:
        return []
    if L == 1:
        return [(0, 1)] * n
    m_cnt = L - 1  # y[i][m] for m = 1..L-1
    nv = n * m_cnt

    def var(i: int, m: int) -> int:
        return i * m_cnt + (m - 1)

    # Objective: min Σ_i (n-i)·S_i  ⇔  max Σ_i (n-i)·T_i  (0-based i).
    c = np.zeros(nv)
    for i in range(n):
        c[i * m_cnt : (i + 1) * m_cnt] = -(n - i)
    rows: list[np.ndarray] = []
    ub: list[float] = []

    def add(row: np.ndarray, bound: float) -> None:
        rows.append(row)
        ub.append(bound)

    for i in range(n):
        for m in range(1, m_cnt):  # monotone: T_i ≥ m+1 ⇒ T_i ≥ m
            r = np.zeros(nv)
            r[var(i, m + 1)] = 1.0
            r[var(i, m)] = -1.0
            add(r, 0.0)
    for i in range(n):
        prev = slice(0, i * m_cnt)  # all y of batches j < i  → Σ_{j<i} T_j
        # C3x (and C2 at m = 1): Σ_{j≤i} #{layers ≥ m} + Σ_{j<i} T_j ≤ i·L - (m-1)·tl  [if y_im]
        for m in range(1, L):
            # Smallest big-M that makes the row vacuous when T_i < m: batches
            # j < i add at most (L-m) + (L-1), so M = i(L-m-1) + (m-1)·tl; a
            # tight M keeps the LP relaxation (and the branch and bound) small.
            big_im = max(0.0, i * (L - m - 1) + (m - 1) * tl) + 1.0
            r = np.zeros(nv)
            r[prev] += 1.0
            for j in range(i + 1):
                r[var(j, m) : var(j, L - 1) + 1] += 1.0
            r[var(i, m)] += big_im
            add(r, i * L - (m - 1) * tl + big_im)
        # C3 (paper, same time origin): tl·(T_i-1) - Σ_{j<i}T_j - (n-i)·(T_i-1) ≤ 0  [if y_i1]
        if paper_c3 and i > 0:
            coef = tl - (n - i)
            r = np.zeros(nv)
            r[prev] -= 1.0
            r[i * m_cnt : (i + 1) * m_cnt] += coef
            big_c3 = max(0.0, -coef) + 1.0  # T_i = 0 leaves -Σ T_j ≤ coef + M
            r[var(i, 1)] += big_c3
            add(r, coef + big_c3)
    # Layer m of batch i must run on the target after it is loaded, (m-1)·tl,
    # and before the source needs the batch, at most i·L: fix the rest to 0.
    upper = np.ones(nv)
    for i in range(n):
        for m in range(1, L):
            if (m - 1) * tl + 1 > i * L + _EPS:
                upper[var(i, m)] = 0.0
    # Imported here: scipy.optimize takes seconds to import, and every process that plans (the
    # gateway validates policies with libs.planning) would pay it at start for an ILP few call.
    from scipy.optimize import Bounds, LinearConstraint, milp

    res = milp(
        c,
        constraints=LinearConstraint(np.vstack(rows), -np.inf, np.array(ub)),
        integrality=np.ones(nv),
        bounds=Bounds(np.zeros(nv), upper),
    )
    if res.x is None:  # pragma: no cover - T ≡ 0 is always feasible
        raise RuntimeError(f"ZigZag ILP failed: {res.message}")
    y = np.rint(res.x).reshape(n, m_cnt)
    return [(int(t), L - int(t)) for t in y.sum(axis=1)]


# ---------------------------------------------------------------------------
# Best-effort (the naive policy of Fig. 15a)
# ---------------------------------------------------------------------------


def best_effort_configs(n_batches: int, n_layers: int, load_time_per_layer: float) -> list[tuple[int, int]]:
    """BlitzScale's naive policy: as many layers on the target as it has, ≤ half.

    The target takes the batches one after another without ever waiting for
    a layer; batch i gets T_i = min(⌊L/2⌋, layers loaded when the target
    starts it).  In Fig. 15 this gives (1, 6) to every batch that starts
    before layer 2 lands — the source then carries almost all the work.
    """
    _check(n_batches, n_layers, load_time_per_layer)
    cap = n_layers // 2
    t = 0.0
    out: list[tuple[int, int]] = []
    for _ in range(n_batches):
        tgt = min(cap, _layers_loaded(t, n_layers, load_time_per_layer))
        out.append((tgt, n_layers - tgt))
        t += tgt
    return out


def fixed_split_configs(n_batches: int, n_layers: int, load_time_per_layer: float) -> list[tuple[int, int]]:
    """A fixed best-effort split: the first batch takes what the target holds (≤ half), every
    later batch the same, whatever lands meanwhile (``PrefillSplitter(policy="fixed")`` at run
    time: its k is frozen at the first batch the target can take).

    Under this module's time model the target holds layer 1 at t = 0, so every batch runs
    (min(1, ⌊L/2⌋), ...): Fig. 15a's "(1, 6)" for all seven requests, the 7th included.
    """
    _check(n_batches, n_layers, load_time_per_layer)
    k = min(n_layers // 2, _layers_loaded(0.0, n_layers, load_time_per_layer))
    return [(k, n_layers - k)] * n_batches


# ---------------------------------------------------------------------------
# Simulation of a live pair for fixed configurations
# ---------------------------------------------------------------------------


def simulate_live_pair(
    configs: Sequence[tuple[int, int]], n_layers: int, load_time_per_layer: float
) -> list[float]:
    """Per-batch latency of a live pair running ``configs`` (see module doc)."""
    _check(len(configs), n_layers, load_time_per_layer)
    tl = float(load_time_per_layer)
    for i, (t_i, s_i) in enumerate(configs):
        if t_i < 0 or s_i < 0 or t_i + s_i != n_layers:
            raise ValueError(f"batch {i}: config {(t_i, s_i)} must be non-negative and sum to {n_layers}")
    n = len(configs)
    done = [0] * n
    target_finish = [0.0] * n
    ready: list[int] = []  # heap of batch indices whose next layer is loaded
    waiting: dict[int, list[int]] = {}  # next layer → batches waiting for it
    loaded = _layers_loaded(0.0, n_layers, tl)
    for i, (t_i, _) in enumerate(configs):
        if t_i == 0:
            continue
        if 1 <= loaded:
            ready.append(i)
        else:  # pragma: no cover - layer 1 is loaded at t = 0
            waiting.setdefault(1, []).append(i)
    heapq.heapify(ready)
    remaining = sum(t for t, _ in configs)
    t = 0.0
    while remaining:
        if not ready:
            # Idle until the next layer lands (Fig. 16: nothing runnable).
            t = max(t, _load_instant(loaded + 1, tl))
        new_loaded = _layers_loaded(t, n_layers, tl)
        while loaded < new_loaded:
            loaded += 1
            for i in waiting.pop(loaded, []):
                heapq.heappush(ready, i)
        if not ready:
            continue
        i = heapq.heappop(ready)
        t += 1.0
        done[i] += 1
        remaining -= 1
        if done[i] == configs[i][0]:
            target_finish[i] = t
        else:
            nxt = done[i] + 1
            if nxt <= _layers_loaded(t, n_layers, tl):
                heapq.heappush(ready, i)
            else:
                waiting.setdefault(nxt, []).append(i)
    latencies: list[float] = []
    source_free = 0.0
    for i, (t_i, s_i) in enumerate(configs):
        if s_i == 0:
            latencies.append(target_finish[i])
            continue
        start = max(source_free, target_finish[i] if t_i else 0.0)
        source_free = start + s_i
        latencies.append(source_free)
    return latencies


# ---------------------------------------------------------------------------
# ILP-free ZigZag (Fig. 16)
# ---------------------------------------------------------------------------


class ZigZagQueue:
    """The target-side priority queue of Fig. 16, for use by a worker.

    Priority (Fig. 16): FCFS, and for the target only requests whose next
    layer is loaded.  The target repeatedly takes :meth:`next_for_target`,
    runs one layer, and reports :meth:`target_done`; the request stays queued
    so the target can come back to it when the next layer lands (the zigzag).
    The source, whenever it has nothing pending, calls
    :meth:`pull_for_source` to take the earliest request not currently on the
    target, with the number of layers already executed, and runs the rest.

    Deterministic and free of I/O; all state lives in the instance.
    """

    def __init__(self, n_layers: int, loaded_layers: int = 0) -> None:
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        self._n_layers = n_layers
        self._loaded = 0
        self._seq = 0
        self._seq_of: dict[Hashable, int] = {}
        self._id_of: dict[int, Hashable] = {}
        self._executed: dict[Hashable, int] = {}
        self._in_flight: Hashable | None = None
        self._ready: list[int] = []  # target-runnable, by arrival sequence
        self._waiting: dict[int, list[int]] = {}  # next layer → sequences
        self._all: list[int] = []  # every queued sequence (lazy deletion)
        self.set_loaded(loaded_layers)

    def __len__(self) -> int:
        return len(self._seq_of)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._seq_of

    @property
    def loaded_layers(self) -> int:
        return self._loaded

    def executed(self, request_id: Hashable) -> int:
        """Layers of the request already run on the target."""
        return self._executed[request_id]

    def push(self, request_id: Hashable) -> None:
        """Enqueue a request in FCFS order (redirected from the source)."""
        if request_id in self._seq_of:
            raise ValueError(f"request {request_id!r} already queued")
        seq = self._seq
        self._seq += 1
        self._seq_of[request_id] = seq
        self._id_of[seq] = request_id
        self._executed[request_id] = 0
        heapq.heappush(self._all, seq)
        self._file(seq, 1)

    def set_loaded(self, n_layers_loaded: int) -> None:
        """The target now holds layers 1..n (never decreases)."""
        n_layers_loaded = min(n_layers_loaded, self._n_layers)
        while self._loaded < n_layers_loaded:
            self._loaded += 1
            for seq in self._waiting.pop(self._loaded, []):
                if seq in self._id_of:
                    heapq.heappush(self._ready, seq)

    def next_for_target(self) -> Hashable | None:
        """Fig. 16 line 2: the earliest request whose next layer is loaded."""
        if self._in_flight is not None:
            raise RuntimeError("the target already runs a layer; call target_done first")
        while self._ready:
            seq = heapq.heappop(self._ready)
            rid = self._id_of.get(seq)
            if rid is None:  # pulled by the source meanwhile
                continue
            self._in_flight = rid
            return rid
        return None

    def target_done(self, request_id: Hashable) -> bool:
        """Fig. 16 line 3 finished one layer; True if the request is complete."""
        if request_id != self._in_flight:
            raise ValueError(f"{request_id!r} is not running on the target")
        self._in_flight = None
        self._executed[request_id] += 1
        seq = self._seq_of[request_id]
        if self._executed[request_id] == self._n_layers:
            self._drop(request_id)
            return True
        self._file(seq, self._executed[request_id] + 1)
        return False

    def pull_for_source(self) -> tuple[Hashable, int] | None:
        """Fig. 16 line 6: take the earliest request not on the target.

        Returns (request, layers already executed); the source runs the rest.
        """
        while self._all:
            seq = self._all[0]
            rid = self._id_of.get(seq)
            if rid is None:
                heapq.heappop(self._all)
                continue
            if rid == self._in_flight:
                # The earliest is mid-layer on the target; take the next one.
                second = self._earliest_except(seq)
                if second is None:
                    return None
                rid = self._id_of[second]
            done = self._executed[rid]
            self._drop(rid)
            return rid, done
        return None

    # -- internals ---------------------------------------------------------

    def _file(self, seq: int, next_layer: int) -> None:
        if next_layer <= self._loaded:
            heapq.heappush(self._ready, seq)
        else:
            self._waiting.setdefault(next_layer, []).append(seq)

    def _drop(self, rid: Hashable) -> None:
        seq = self._seq_of.pop(rid)
        del self._id_of[seq]
        del self._executed[rid]

    def _earliest_except(self, skip: int) -> int | None:
        best: int | None = None
        for seq in self._all:
            if seq != skip and seq in self._id_of and (best is None or seq < best):
                best = seq
        return best


@dataclass(frozen=True)
class ZigZagRun:
    """Outcome of :func:`simulate_zigzag_queue`: what each batch ended up with."""

    configs: list[tuple[int, int]]
    latencies: list[float]


def simulate_zigzag_queue(n_batches: int, n_layers: int, load_time_per_layer: float) -> ZigZagRun:
    """Drive :class:`ZigZagQueue` with both instances under the module's time model.

    The source pulls whenever it is free (at equal instants before the
    target picks, since it is the instance already serving); the target runs
    one layer at a time.  Returns the configurations that emerged and the
    per-batch latencies — the ILP-free counterpart of :func:`zigzag_ilp`.
    """
    _check(n_batches, n_layers, load_time_per_layer)
    tl = float(load_time_per_layer)
    q = ZigZagQueue(n_layers, _layers_loaded(0.0, n_layers, tl))
    for i in range(n_batches):
        q.push(i)
    configs: list[tuple[int, int]] = [(0, 0)] * n_batches
    lat: list[float] = [0.0] * n_batches
    t = 0.0
    src_free = 0.0
    tgt_job: int | None = None
    tgt_end = 0.0
    finished = 0
    while finished < n_batches:
        if tgt_job is not None and tgt_end <= t + _EPS:
            if q.target_done(tgt_job):
                configs[tgt_job] = (n_layers, 0)
                lat[tgt_job] = tgt_end
                finished += 1
            tgt_job = None
        q.set_loaded(_layers_loaded(t, n_layers, tl))
        if src_free <= t + _EPS:
            pulled = q.pull_for_source()
            if pulled is not None:
                rid, done = pulled
                s = n_layers - done
                src_free = t + s
                configs[rid] = (done, s)  # type: ignore[index]
                lat[rid] = src_free  # type: ignore[index]
                finished += 1
        if tgt_job is None:
            nxt = q.next_for_target()
            if nxt is not None:
                tgt_job = nxt  # type: ignore[assignment]
                tgt_end = t + 1.0
        if finished == n_batches:
            break
        # Advance to the next instant something can change.
        cands = []
        if tgt_job is not None:
            cands.append(tgt_end)
        if src_free > t + _EPS:
            cands.append(src_free)
        if tgt_job is None and q.loaded_layers < n_layers:
            cands.append(_load_instant(q.loaded_layers + 1, tl))
        nxt_t = min((c for c in cands if c > t + _EPS), default=None)
        if nxt_t is None:  # pragma: no cover - something is always pending
            raise RuntimeError("zigzag simulation stalled")
        t = nxt_t
    return ZigZagRun(configs=configs, latencies=lat)
