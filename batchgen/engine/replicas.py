"""Replica check: the ranks of a tensor-parallel group must take the very same decisions.

Each rank runs its own scheduler on the same inputs; they agree because everything they see
is identical (requests, pool sizes agreed at start, all-reduced activations, replicated
logits). `BATCHGEN_CHECK_REPLICAS=N` folds every step's decisions into a running digest and
compares it across the group every N steps, before the forward, so a divergence fails loudly
instead of hanging in a collective whose shapes no longer match. Off by default: it costs one
small all-gather per checked step.
"""

from __future__ import annotations

import os

from batchgen.parallel import TensorParallel, digest
from batchgen.sched.scheduler import ScheduleOutput
from batchgen.testing import faults

CHECK_ENV = "BATCHGEN_CHECK_REPLICAS"
"""Compare the replicas' decisions every this many engine steps, a decode burst counting as
one (unset or 0: never)."""


class ReplicaDivergence(RuntimeError):
    pass


class ReplicaCheck:
    def __init__(self, tp: TensorParallel, every: int, fault=None):
        """fault: the reliability tests' tampering with the decisions
        (batchgen.testing.faults.replica_fault), else None."""
        self.tp, self.every, self.fault = tp, every, fault
        self.running = bytes(8)
        self._calls = 0
        """observe() calls so far: the cadence counts calls, not forwards, so ranks stay paired
        in the all-gather even after one of them diverges into other burst lengths."""

    @staticmethod
    def from_env(tp: TensorParallel) -> ReplicaCheck | None:
        every = int(os.environ.get(CHECK_ENV, "0") or 0)
        if every <= 0 or tp.size == 1:
            return None
        return ReplicaCheck(tp, every, faults.replica_fault(tp.rank))

    def observe(self, step: int, out: ScheduleOutput) -> None:
        """Fold this step's decisions in; on a checked step, compare with the other ranks.
        `step` counts forwards, so it jumps by a decode burst's length between calls."""
        if self.fault is not None:
            self.fault(step, out.chunks)
        chunks = [(c.seq.seq_id, c.start, c.end, c.sample) for c in out.chunks]
        copies = [(c.seq_id, tuple(c.src), tuple(c.dst)) for c in (*out.swap_out, *out.swap_in)]
        self.running = digest(self.running, chunks, copies)
        self._calls += 1
        if (self._calls - 1) % self.every:
            return
        digests = self.tp.gather_digests(self.running)
        if len(set(digests)) > 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            raise ReplicaDivergence(
                f"tensor-parallel replicas diverged by step {step}: the scheduling decisions of "
                f"group rank(s) {odd} differ from rank 0's. This is a bug (or non-identical "
                f"inputs/pools across ranks); the job stops rather than hang in a collective.")
