"""DataCoord's channel manager (Milvus' DataCoord server; Milvus' MEP 7, watch and
release channels via etcd): which DataNode watches which vchannel, written to
`channelwatch/{nodeID}/{vchannel}`.

The manager keeps no state of its own: `reconcile(now)` reads the node sessions, the
catalog's vchannels and every watch info, takes one step towards "every channel watched
by exactly one live node, balanced by count", and returns what it did. A coordinator
loop calls it every half second; a Dagster sensor tick can call it just the same, and a
standby that takes over simply continues from what etcd says.

Only a HEALTHY DataNode session counts as a live node (Milvus' stateCode): an
INITIALIZING, ABNORMAL or STOPPING node gets no channel, and the channels of a STOPPING
node (a graceful stop) move at once, without waiting for its session to end. A node
STOPPING for longer than VCHAN_STOP_TIMEOUT is cut off: its session lease is revoked.

Rules of one step, per vchannel of every non-dropped collection:
- a watch info of a node whose session is gone or not HEALTHY is replaced, in one
  transaction, by the channel's ToWatch for another node with a NEW lease (granting it
  fences off the old writer, as in the lease design of Milvus' "DataNode removes its
  dependency on DataCoord"); with no live node it is deleted;
- a WatchSuccess without a lease id (written by an older coordinator, served through
  DataCoord's watcher check) is upgraded: the channel's lease for its node is written
  into it (the node's current lease if it has one, else a new one), one transaction;
- WatchFailure, ReleaseSuccess/ReleaseFailure, ToWatch/ToRelease past `timeout_ts`
  (pushed back by the node's tickler), or ToWatch/WatchSuccess naming a lease that is no
  longer `channel-lease/{vchannel}` (its node was fenced and stopped) -> deleted, and the
  channel reassigned;
- an unassigned channel goes to the live node with the fewest channels (ToWatch with a
  fresh lease id, written in the same transaction; a step's assignments share
  transactions, `ASSIGN_BATCH` channels each), or, with no live node, waits in
  `channelwatch/remaining/{vchannel}`;
- when nothing is moving, and no live DataNode runs a package older than the balance
  version (VCHAN_BALANCE_VERSION, default this coordinator's; Milvus'
  `updateBalanceConfigLoop`: a mixed cluster is not rebalanced until every older node
  is gone), a node with 2+ channels more than another gives one up:
  ToRelease on the old node first; only after its ReleaseSuccess (or its death or
  timeout) is the channel written as ToWatch for another node. Never two watchers;
- a channel of a dropped collection is released and its watch info removed.
Every write is a compare-version-and-swap on the version read, so a node answering at
the same moment (or a second coordinator) makes the step skip, not clobber.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from vchan_assets import __version__
from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.leases import new_channel_lease
from vchan_assets.datacoord.recovery import RecoverySnapshot
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.channelwatch import WatchEntry, list_watches
from vchan_assets.meta.codec import encode
from vchan_assets.meta.errors import CasConflictError
from vchan_assets.meta.store import KeyValue, MetaStore
from vchan_assets.model import (
    ChannelLease,
    ChannelWatchInfo,
    CollectionInfo,
    NodeSession,
    SessionState,
    VchannelInfo,
    WatchState,
)

log = logging.getLogger(__name__)

HOLDING = (WatchState.TO_WATCH, WatchState.WATCH_SUCCESS, WatchState.TO_RELEASE)
MOVING = (WatchState.TO_WATCH, WatchState.TO_RELEASE)


@dataclass
class ReconcileReport:
    """What one `reconcile` step did (empty lists: nothing to do)."""

    live_nodes: tuple[int, ...] = ()
    assigned: list[tuple[str, int]] = field(default_factory=list)  # (vchannel, node) ToWatch
    releasing: list[tuple[str, int, str]] = field(default_factory=list)  # (vchannel, node, why)
    removed: list[tuple[str, int, str]] = field(default_factory=list)  # (vchannel, node, why)
    remaining: list[str] = field(default_factory=list)  # newly parked: no live node
    conflicts: int = 0  # CAS lost to a concurrent writer: retried next step
    upgraded: list[tuple[str, int]] = field(default_factory=list)  # (vchannel, node) lease-less -> leased
    balance_held: list[int] = field(default_factory=list)  # live nodes older than the balance version
    cut_off: list[int] = field(default_factory=list)  # nodes past VCHAN_STOP_TIMEOUT: session revoked
    malformed: list[str] = field(default_factory=list)  # keys logged and skipped

    @property
    def changed(self) -> bool:
        return bool(
            self.assigned or self.releasing or self.removed or self.remaining or self.upgraded or self.cut_off
        )


@dataclass(frozen=True)
class ChannelView:
    """The cluster picture a step works from: `nodes` are the HEALTHY DataNodes (the ones
    that may hold channels), `sessions` every DataNode session in any state."""

    nodes: dict[int, NodeSession]
    channels: dict[str, CollectionInfo]
    entries: dict[str, list[WatchEntry]]
    remaining: dict[str, KeyValue]
    malformed: list[KeyValue]
    leases: dict[str, ChannelLease] = field(default_factory=dict)  # vchannel -> current lease
    sessions: dict[int, KeyValue] = field(default_factory=dict)
    states: dict[int, NodeSession] = field(default_factory=dict)  # every session's value


def _fenced(e: WatchEntry, current: ChannelLease | None) -> str:
    """Why a watch info no longer holds its channel because another lease replaced its
    own (its node's commits are refused and it stopped the channel), or ""."""
    if e.info.lease_id is None or current is None or current.lease_id == e.info.lease_id:
        return ""  # no lease named (older coordinator), or still the current one
    return f"lease {e.info.lease_id} replaced by {current.lease_id} (node {current.node_id})"


# Channels per assignment transaction: etcd refuses more than 128 operations in one
# (--max-txn-ops; a channel takes two puts and perhaps a delete), and a request over
# --max-request-bytes (a watch info lists the channel's segment ids).
ASSIGN_BATCH = 40
ASSIGN_BATCH_BYTES = 256 * 1024


@dataclass(frozen=True)
class _Assignment:
    """One channel's lease and ToWatch, encoded, not yet written."""

    vchannel: str
    node_id: int
    watch_key: str
    puts: dict[str, bytes]
    deletes: tuple[str, ...]  # its channelwatch/remaining entry, if it waited there
    replaced: tuple[tuple[WatchEntry, str], ...] = ()  # watch infos of a node not live, and why

    @property
    def size(self) -> int:
        return sum(len(v) for v in self.puts.values())


def _batches(pending: list[_Assignment]) -> Iterator[list[_Assignment]]:
    batch: list[_Assignment] = []
    size = 0
    for a in pending:
        if batch and (len(batch) == ASSIGN_BATCH or size + a.size > ASSIGN_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(a)
        size += a.size
    if batch:
        yield batch


class ChannelManager:
    """Assigns vchannels to DataNodes through etcd; see the module docstring."""

    def __init__(self, store: MetaStore, settings: Settings, ids: IdAllocator | None = None) -> None:
        self.store = store
        self.settings = settings
        self.ids = ids or IdAllocator(store)
        self.catalog = CollectionRegistry(store, self.ids)

    # --- reading the picture -------------------------------------------------------------

    def live_nodes(self) -> dict[int, NodeSession]:
        """HEALTHY DataNodes by their sessions; malformed session values are logged, skipped."""
        return {n: s for n, (s, _) in self._sessions().items() if s.state is SessionState.HEALTHY}

    def _sessions(self) -> dict[int, tuple[NodeSession, KeyValue]]:
        """Every DataNode session, in any state."""
        found, _ = self.store.list_models(
            self.store.keys.datanode_session.prefix, NodeSession, skip_malformed=True
        )
        sessions = {}
        for d in found:
            if d.kv.key != self.store.keys.datanode_session(d.model.node_id):
                log.error("skipping session %s: it names node %s", d.kv.key, d.model.node_id)
                continue
            sessions[d.model.node_id] = (d.model, d.kv)
        return sessions

    def view(self) -> ChannelView:
        sessions = self._sessions()
        nodes = {n: s for n, (s, _) in sessions.items() if s.state is SessionState.HEALTHY}
        channels = {v: c for c in self.catalog.list() for v in c.vchannels}
        listing = list_watches(self.store)
        entries: dict[str, list[WatchEntry]] = {}
        for e in listing.entries:
            entries.setdefault(e.vchannel, []).append(e)
        for bad in listing.malformed:
            log.error("channel manager: skipping %s", bad.error)
        malformed = [bad.kv for bad in listing.malformed]
        # Read after the watch infos: a lease is written with its ToWatch, so every lease
        # id a listed watch info names is here, or a newer one.
        return ChannelView(
            nodes,
            channels,
            entries,
            listing.remaining,
            malformed,
            self._leases(),
            {n: kv for n, (_, kv) in sessions.items()},
            {n: s for n, (s, _) in sessions.items()},
        )

    def _leases(self) -> dict[str, ChannelLease]:
        prefix = self.store.keys.channel_lease.prefix
        found, _ = self.store.list_models(prefix, ChannelLease, skip_malformed=True)
        return {d.kv.key[len(prefix) :]: d.model for d in found}

    def assignments(self) -> dict[str, list[tuple[int, WatchState]]]:
        """vchannel -> [(node, state)] as etcd has it now (for status and tests)."""
        return {v: [(e.node_id, e.info.state) for e in es] for v, es in self.view().entries.items()}

    # --- one step ------------------------------------------------------------------------

    def reconcile(self, now: float | None = None) -> ReconcileReport:
        """One step towards every channel watched by exactly one live node, balanced."""
        now = time.time() if now is None else now
        view = self.view()
        report = ReconcileReport(live_nodes=tuple(sorted(view.nodes)))
        self._cut_off(view, now, report)
        for kv in view.malformed:
            report.malformed.append(kv.key)
            node = kv.key[len(self.store.keys.channel_watch.prefix) :].split("/")[0]
            if not node.isdigit() or int(node) not in view.nodes:
                self._delete(kv, report)  # garbage of a dead node: nobody will ever answer it
        load = {n: 0 for n in view.nodes}
        for es in view.entries.values():
            for e in es:
                if e.node_id in load and e.info.state in HOLDING:
                    load[e.node_id] += 1
        moving = False
        recovery = RecoverySnapshot(self.store)  # read once, if anything is assigned
        pending: list[_Assignment] = []
        for vchannel in sorted(set(view.channels) | set(view.entries) | set(view.remaining)):
            collection = view.channels.get(vchannel)
            entries = view.entries.get(vchannel, [])
            if collection is None:
                self._retire(vchannel, entries, view, report)
                continue
            holders, exclude, leaving = self._settle(vchannel, entries, view, load, now, report)
            if holders or not view.nodes:
                for e, why in leaving:
                    self._delete(e.kv, report, vchannel, e.node_id, why)
            if holders:
                moving |= any(h.info.state in MOVING for h in holders)
                if holders[0].info.lease_id is None and holders[0].info.state is WatchState.WATCH_SUCCESS:
                    self._upgrade(holders[0], view, report)
                for extra in holders[1:]:  # two holders never arise from this manager; heal it
                    self._to_release(extra, "a second watcher", report)
                continue
            if not view.nodes:
                if vchannel not in view.remaining:
                    self.store.put(
                        self.store.keys.remaining_channel(vchannel), VchannelInfo(collection.id, vchannel)
                    )
                    report.remaining.append(vchannel)
                    log.warning("no live DataNode: %s waits in channelwatch/remaining", vchannel)
                continue
            candidates = [n for n in load if n not in exclude] or list(load)
            target = min(candidates, key=lambda n: (load[n], n))
            parked = view.remaining.get(vchannel)
            pending.append(self._assignment(collection, vchannel, target, now, recovery, parked, leaving))
            load[target] += 1
        for lost in self._write_assignments(pending, report):
            load[lost.node_id] -= 1
        moving |= bool(report.assigned)
        report.balance_held = [
            n for n, s in sorted(view.states.items()) if s.older_than(self.balance_version)
        ]
        if (
            not moving and not report.balance_held and self.settings.auto_balance
        ):  # VCHAN_AUTO_BALANCE=off: channels stay put
            self._balance(view, load, report)
        if report.changed:
            log.info(
                "reconcile: nodes %s assigned %s releasing %s removed %s remaining %s upgraded %s cut off %s",
                list(report.live_nodes),
                report.assigned,
                report.releasing,
                report.removed,
                report.remaining,
                report.upgraded,
                report.cut_off,
            )
        return report

    @property
    def balance_version(self) -> str:
        return self.settings.balance_version or __version__

    # --- the rules -----------------------------------------------------------------------

    def _settle(
        self,
        vchannel: str,
        entries: list[WatchEntry],
        view: ChannelView,
        load: dict[int, int],
        now: float,
        report: ReconcileReport,
    ) -> tuple[list[WatchEntry], set[int], list[tuple[WatchEntry, str]]]:
        """Sort the watch infos of a channel: those that hold it; the nodes not to pick
        again for it; and those that no longer hold it, with why (a node gone or not
        HEALTHY, an answered release, a failed or stuck watch, a fenced lease). Those are
        deleted by the caller, or, when the channel is assigned again, replaced by the new
        ToWatch in its transaction, so the channel is never without a watch info between two
        etcd round trips."""
        holders: list[WatchEntry] = []
        exclude: set[int] = set()
        leaving: list[tuple[WatchEntry, str]] = []
        for e in entries:
            state = e.info.state
            why = ""
            if e.node_id not in view.nodes:
                session = view.states.get(e.node_id)
                leaving.append(
                    (e, "node session is gone" if session is None else f"node is {session.state.value}")
                )
                continue
            if state in (WatchState.RELEASE_SUCCESS, WatchState.RELEASE_FAILURE):
                why = f"node answered {state.value}"
                exclude.add(e.node_id)
            elif state is WatchState.WATCH_FAILURE:
                why = f"watch failed: {e.info.reason}"
                exclude.add(e.node_id)
            elif state in MOVING and now > e.info.timeout_ts:
                why = f"{state.value} stuck past the watch timeout"
                exclude.add(e.node_id)
            elif state in (WatchState.TO_WATCH, WatchState.WATCH_SUCCESS):
                why = _fenced(e, view.leases.get(vchannel))
            if not why:
                holders.append(e)
                continue
            leaving.append((e, why))
            if e.node_id in load and state in HOLDING:
                load[e.node_id] -= 1
        holders.sort(key=lambda e: (e.info.state is not WatchState.WATCH_SUCCESS, e.node_id))
        return holders, exclude, leaving

    def _retire(
        self, vchannel: str, entries: list[WatchEntry], view: ChannelView, report: ReconcileReport
    ) -> None:
        """A channel of a dropped (or unknown) collection: release it, then forget it."""
        for e in entries:
            if e.node_id in view.nodes and e.info.state in (WatchState.TO_WATCH, WatchState.WATCH_SUCCESS):
                self._to_release(e, "collection dropped", report)
            elif e.node_id not in view.nodes or e.info.state is not WatchState.TO_RELEASE:
                self._delete(e.kv, report, vchannel, e.node_id, "collection dropped")
        if vchannel in view.remaining:
            self.store.delete(view.remaining[vchannel].key)

    def _assignment(
        self,
        collection: CollectionInfo,
        vchannel: str,
        node_id: int,
        now: float,
        snapshot: RecoverySnapshot,
        parked: KeyValue | None,
        replaced: list[tuple[WatchEntry, str]] | None = None,
    ) -> _Assignment:
        """ToWatch on `node_id` with a fresh lease (which fences off any earlier writer),
        to be written by `_write_assignments`."""
        recovery = snapshot.recovery_info(collection, vchannel)
        lease = new_channel_lease(self.ids, node_id)
        info = ChannelWatchInfo(
            vchan=VchannelInfo(
                collection.id,
                vchannel,
                recovery.seek_position,
                recovery.unflushed_segment_ids,
                recovery.flushed_segment_ids,
                recovery.dropped_segment_ids,
            ),
            state=WatchState.TO_WATCH,
            start_ts=now,
            timeout_ts=now + self.settings.watch_timeout,
            op_id=lease.lease_id,
            lease_id=lease.lease_id,
        )
        watch_key = self.store.keys.channel_watch(node_id, vchannel)
        return _Assignment(
            vchannel,
            node_id,
            watch_key,
            {self.store.keys.channel_lease(vchannel): encode(lease), watch_key: encode(info)},
            () if parked is None else (parked.key,),
            tuple(replaced or ()),
        )

    def _write_assignments(self, pending: list[_Assignment], report: ReconcileReport) -> list[_Assignment]:
        """Write the step's assignments, many channels per etcd transaction (a cold start
        assigns every channel in one step: one round trip each took seconds at 1,000
        channels, BENCHMARKS.md "Scale"). A channel's lease and its ToWatch are written
        together or not at all (a ToWatch that cannot be written grants no lease, else the
        current holder would be fenced off for nothing). A batch that loses a compare is
        written again one channel at a time; returns the channels that lost theirs."""
        lost: list[_Assignment] = []
        for batch in _batches(pending):
            if self._write(batch):
                written = batch
            else:
                written = [a for a in batch if len(batch) > 1 and self._write([a])]
            report.assigned.extend((a.vchannel, a.node_id) for a in written)
            report.removed.extend((a.vchannel, e.node_id, why) for a in written for e, why in a.replaced)
            lost.extend(a for a in batch if a not in written)
        report.conflicts += len(lost)
        return lost

    def _write(self, batch: list[_Assignment]) -> bool:
        expect: dict[str, int] = {}
        deletes: list[str] = []
        for a in batch:
            expect[a.watch_key] = 0
            deletes.extend(a.deletes)
            for e, _ in a.replaced:
                expect[e.kv.key] = e.kv.version
                if e.kv.key != a.watch_key:  # the same node again: the ToWatch overwrites it
                    deletes.append(e.kv.key)
        puts = {k: v for a in batch for k, v in a.puts.items()}
        return self.store.txn(expect, puts, deletes) is not None

    def _to_release(self, e: WatchEntry, why: str, report: ReconcileReport) -> bool:
        now = time.time()
        info = replace(
            e.info,
            state=WatchState.TO_RELEASE,
            start_ts=now,
            timeout_ts=now + self.settings.watch_timeout,
            progress=0,
        )
        try:
            self.store.cas(e.kv.key, e.kv.version, info)
        except CasConflictError:
            report.conflicts += 1
            return False
        report.releasing.append((e.vchannel, e.node_id, why))
        return True

    def _delete(
        self,
        kv: KeyValue,
        report: ReconcileReport,
        vchannel: str = "",
        node_id: int = 0,
        why: str = "malformed",
    ) -> bool:
        try:
            self.store.cas(kv.key, kv.version, None)
        except CasConflictError:
            report.conflicts += 1
            return False
        report.removed.append((vchannel or kv.key, node_id, why))
        return True

    def _cut_off(self, view: ChannelView, now: float, report: ReconcileReport) -> None:
        """Revoke the session of every node STOPPING for longer than VCHAN_STOP_TIMEOUT (its
        channels moved already): it never finished its stop, so it is made to leave."""
        for node_id, session in view.states.items():
            if session.state is not SessionState.STOPPING or not session.since:
                continue
            if now - session.since <= self.settings.stop_timeout:
                continue
            lease = view.sessions[node_id].lease
            log.error(
                "node %s has been STOPPING for %.1fs (VCHAN_STOP_TIMEOUT %ss): revoking its session",
                node_id,
                now - session.since,
                self.settings.stop_timeout,
            )
            if lease:
                self.store.revoke(lease)
            else:
                self.store.cas(view.sessions[node_id].key, view.sessions[node_id].version, None)
            report.cut_off.append(node_id)

    def _upgrade(self, e: WatchEntry, view: ChannelView, report: ReconcileReport) -> None:
        """Write the channel's lease into a lease-less WatchSuccess (an older coordinator's):
        the lease its node already commits under (granted by the watcher check), or a new
        one for it. One transaction on the watch info's and the lease's versions read, so a
        channel moved meanwhile keeps its new owner's lease."""
        lease_key = self.store.keys.channel_lease(e.vchannel)
        current = self.store.get_model(lease_key, ChannelLease)
        if current is not None and current.model.node_id == e.node_id:
            lease = current.model
        else:
            lease = new_channel_lease(self.ids, e.node_id)
        info = replace(e.info, lease_id=lease.lease_id)
        expect = {e.kv.key: e.kv.version, lease_key: current.kv.version if current else 0}
        if self.store.txn(expect, {lease_key: lease, e.kv.key: info}) is None:
            report.conflicts += 1
            return
        view.leases[e.vchannel] = lease
        report.upgraded.append((e.vchannel, e.node_id))
        log.info(
            "upgraded the lease-less watch of %s on node %s to lease %s",
            e.vchannel,
            e.node_id,
            lease.lease_id,
        )

    def _balance(self, view: ChannelView, load: dict[int, int], report: ReconcileReport) -> None:
        """Move channels from the busiest node to the idlest until counts differ by <= 1;
        a move starts with ToRelease, the ToWatch follows after ReleaseSuccess."""
        if len(load) < 2:
            return
        owned: dict[int, list[WatchEntry]] = {n: [] for n in load}
        for es in view.entries.values():
            for e in es:
                if (
                    e.node_id in owned
                    and e.info.state is WatchState.WATCH_SUCCESS
                    and e.vchannel in view.channels
                ):
                    owned[e.node_id].append(e)
        while True:
            busiest = max(load, key=lambda n: (load[n], n))
            idlest = min(load, key=lambda n: (load[n], n))
            if load[busiest] - load[idlest] <= 1 or not owned[busiest]:
                return
            entry = sorted(owned[busiest], key=lambda e: e.vchannel).pop()
            owned[busiest].remove(entry)
            if self._to_release(
                entry, f"balance: node {busiest} has {load[busiest]}, node {idlest} {load[idlest]}", report
            ):
                load[busiest] -= 1
                load[idlest] += 1
