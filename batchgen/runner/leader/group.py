"""The members of one run of a job agreeing over a TCPStore: what to run, who is alive, who
finished. Only the leader (member 0) writes the batch file and merges the outputs.

Two kinds of group use it (supervisor.py picks):
- nodes: `batchgen run --nnodes N --node-rank R` on each node; member = node rank. The store
  lives in node 0's supervisor at --dist-init-addr; the launcher's static rendezvous opens the
  same host:port in the same process and shares that server (TCPStore multi_tenant).
- ranks: every process of an external torchrun / srun is one rank; member = global rank. The
  store is at MASTER_ADDR:MASTER_PORT: torchrun's agent store, or hosted by rank 0 under srun.

Keys (under a prefix unique to the run):
  beat/{m}   counter member m bumps every `beat_s` (the leader's liveness check)
  plan       the leader's decision (JSON): launch (with the spec), done, or abort (a reason)
  seen/{m}   member m read the plan (a leader ending the run waits for it before it exits)
  ready/{m}  member m checked the plan against its own flags and storage
  end/{m}    member m's end (JSON): code 0 = all its ranks finished their shards and fsynced
Why a store and not the launcher's exit barrier: that barrier gives up after 300 s and swallows
its errors, while data-parallel shards can finish hours apart. Why not marker files on the shared
filesystem: NFS caches directory entries and attributes for up to a minute, so a fresh marker can
stay invisible or a stale one visible; the store answers at once and is new for every run.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

log = logging.getLogger("batchgen")
DEAD_ENV = "BATCHGEN_GROUP_DEAD_S"
"""Seconds without a heartbeat after which a member counts as dead (default 60)."""
JOIN_ENV = "BATCHGEN_GROUP_JOIN_S"
"""Seconds members may start apart from each other (default 1800)."""


class GroupError(RuntimeError):
    """The group cannot run: the leader gave up, a member disagrees, the store is gone."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class PlanRefused(GroupError):
    """A follower refused the plan or never joined: nothing ran."""


@dataclass(frozen=True)
class GroupTimeouts:
    join_s: float = 1800.0
    """How long members wait for each other to appear (nodes are started by hand or by srun)."""
    dead_s: float = 60.0
    """A member that joined and then stays silent this long is dead (killed, or its host is)."""
    beat_s: float = 2.0
    """Heartbeat period."""

    @staticmethod
    def from_env() -> GroupTimeouts:
        env = os.environ
        return GroupTimeouts(float(env.get(JOIN_ENV, 1800.0)), float(env.get(DEAD_ENV, 60.0)))


@dataclass(frozen=True)
class MemberEnd:
    """How a member's ranks ended; code 0 = finished. `rank` is the global rank that failed."""

    member: int
    code: int
    rank: int = -1
    exitcode: int = 0
    log_tail: str = ""
    log_path: str = ""
    cause: str = ""
    """Set when the member's own process could not report (dead): what the leader saw."""


def open_store(host: str, port: int, is_master: bool, timeout_s: float):
    """A TCPStore client, or its server when `is_master` (multi-tenant: the launcher's
    rendezvous and torch's env:// init in this process reuse the same server)."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, is_master=is_master, timeout=timedelta(seconds=timeout_s),
                        multi_tenant=True, wait_for_workers=False)
    except Exception as err:  # noqa: BLE001 (DistNetworkError, RuntimeError: name the address)
        role = "listen on" if is_master else "reach"
        raise GroupError(f"could not {role} the group's store at {host}:{port} ({err}); check "
                         "--dist-init-addr (MASTER_ADDR/MASTER_PORT) and that the port is free "
                         "and reachable from every node") from None


@dataclass
class Group:
    store: object
    member: int
    members: int
    kind: str = "node"
    """What a member is, for messages: "node" or "rank"."""
    prefix: str = "batchgen"
    timeouts: GroupTimeouts = field(default_factory=GroupTimeouts)
    failure: MemberEnd | None = None
    """Set by the watch thread when a member failed or died (leader) or the leader left."""
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _watch_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _watching: bool = False
    _threads: list = field(default_factory=list, repr=False)

    @property
    def leader(self) -> bool:
        return self.member == 0

    def _key(self, *parts) -> str:
        return "/".join((self.prefix, *map(str, parts)))

    def start_beating(self, on_lost=None) -> None:
        """Bump our heartbeat every beat_s; a follower that loses the store (the leader's
        process is gone) calls `on_lost(reason)` once."""
        self.store.add(self._key("beat", self.member), 1)

        def beat() -> None:
            while not self._stop.wait(self.timeouts.beat_s):
                try:
                    self.store.add(self._key("beat", self.member), 1)
                except Exception as err:  # noqa: BLE001 (the store's server died with the leader)
                    if on_lost and not self._stop.is_set():
                        on_lost(f"lost the group's store (member 0 is gone?): {err}")
                    return

        self._spawn(beat, "batchgen-group-beat")

    def close(self) -> None:
        """Stop our threads, then drop the store while the interpreter is fully alive: a
        TCPStore server torn down during interpreter exit can abort the process (seen under
        srun: "terminate called without an active exception" after a clean run)."""
        self.unwatch()
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._threads.clear()
        self.store = None

    # ---- the leader

    def publish(self, action: str, **fields) -> None:
        self.store.set(self._key("plan"), json.dumps({"action": action, **fields}))

    def publish_final(self, action: str, wait_s: float = 30.0, **fields) -> None:
        """A plan that ends the run ("done", "abort"): the store dies with the leader's
        process, so give the followers up to `wait_s` to read it first."""
        self.publish(action, **fields)
        deadline = time.monotonic() + wait_s
        keys = [self._key("seen", m) for m in range(1, self.members)]
        while keys and not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.1)

    def wait_ready(self) -> None:
        """Every follower accepted the plan; raises GroupError with the first refusal."""
        self._wait(lambda m: self.store.check([self._key("ready", m)]), PlanRefused)

    def wait_ends(self) -> None:
        """Every follower reported code 0; raises GroupError naming a failed or dead member."""
        self._wait(lambda m: self.store.check([self._key("end", m)]), GroupError)

    def _wait(self, arrived, error: type[GroupError]) -> None:
        pending = set(range(1, self.members))
        watch = _Liveness(self, pending)
        while pending:
            for m in sorted(pending):
                end = self.end_of(m)
                if end is not None and end.code != 0:
                    self.failure = end
                    raise error(end.cause or f"{self.kind} {m} ended with code {end.code}",
                                end.code)
                if arrived(m):
                    pending.discard(m)
            if self._stop.is_set():
                raise error(f"the group was closed while waiting for {sorted(pending)}")
            dead = watch.dead(pending)
            if dead is not None:
                self.failure = dead
                raise error(dead.cause)
            if pending:
                time.sleep(0.2)

    def end_of(self, member: int) -> MemberEnd | None:
        key = self._key("end", member)
        if not self.store.check([key]):
            return None
        return MemberEnd(**json.loads(self.store.get(key)))

    def watch(self, on_failure) -> None:
        """Leader, while its own ranks run: call `on_failure(end)` once when a follower fails or
        dies (the caller stops its own ranks and ends the run naming that member)."""

        def run() -> None:
            try:
                self.wait_ends()
            except GroupError:
                with self._watch_lock:
                    if self._watching:
                        on_failure(self.failure)
            except Exception as err:  # noqa: BLE001 (the store failed: nothing to watch with)
                log.warning("group watch stopped: %s", err)

        self._watching = True
        self._spawn(run, "batchgen-group-watch")

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def unwatch(self) -> None:
        """From now on the caller waits itself (`wait_ends`): the watch thread stays quiet."""
        with self._watch_lock:
            self._watching = False

    # ---- a follower

    def plan(self) -> dict:
        """Wait for the leader's plan (it may scan a large input or convert weights first)."""
        key = self._key("plan")
        try:
            while not self.store.check([key]):
                time.sleep(0.2)
            plan = json.loads(self.store.get(key))
            self.store.set(self._key("seen", self.member), "1")
            return plan
        except Exception as err:  # noqa: BLE001 (the store's server died with the leader)
            raise GroupError(f"lost the leader before it published a plan: {err}") from None

    def ready(self) -> None:
        self.store.set(self._key("ready", self.member), "1")

    def report(self, end: MemberEnd) -> None:
        self.store.set(self._key("end", self.member), json.dumps(end.__dict__))


class _Liveness:
    """The leader's view of the followers' heartbeats: silent too long = dead."""

    def __init__(self, group: Group, members: set[int]):
        self.group = group
        now = time.monotonic()
        self.seen = {m: (group.store.add(group._key("beat", m), 0), now) for m in members}

    def dead(self, pending: set[int]) -> MemberEnd | None:
        g, now = self.group, time.monotonic()
        for m in sorted(pending):
            beats = g.store.add(g._key("beat", m), 0)
            last, since = self.seen[m]
            if beats != last:
                self.seen[m] = (beats, now)
                continue
            limit = g.timeouts.dead_s if beats else g.timeouts.join_s
            if now - since > limit:
                how = (f"stopped responding (no heartbeat for {limit:g} s: killed, or its host "
                       "or the network failed)" if beats else f"never joined within {limit:g} s")
                return MemberEnd(m, 1, cause=f"{g.kind} {m} {how}")
        return None
