"""The keys under `channelwatch/`, read one way by everyone (coordinator, node, catalog).

    channelwatch/{nodeID}/{vchannel}     a ChannelWatchInfo: the node watches the vchannel
    channelwatch/remaining/{vchannel}    a VchannelInfo: no live node to give it to yet

`parse_watch_info` decodes one watch info and checks that it names its key's vchannel;
`list_watches` reads the whole prefix into entries, remaining channels and malformed
keys (each with its error naming the key), so one bad key never hides the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vchan_assets.meta.codec import decode
from vchan_assets.meta.errors import MalformedValueError
from vchan_assets.meta.store import KeyValue, MetaStore
from vchan_assets.model import ChannelWatchInfo, WatchState

# A node's answers, which the coordinator waits for and a node ignores (Milvus' isEndWatchState).
END_STATES = frozenset(
    {
        WatchState.WATCH_SUCCESS,
        WatchState.WATCH_FAILURE,
        WatchState.RELEASE_SUCCESS,
        WatchState.RELEASE_FAILURE,
    }
)

REMAINING = "remaining"


@dataclass(frozen=True)
class WatchEntry:
    """One `channelwatch/{nodeID}/{vchannel}` key, decoded."""

    node_id: int
    vchannel: str
    info: ChannelWatchInfo
    kv: KeyValue


@dataclass(frozen=True)
class MalformedWatch:
    """A key under `channelwatch/` whose name or value is not what it should be."""

    node: str  # the key's node part, as written
    vchannel: str
    error: str
    kv: KeyValue


@dataclass
class WatchListing:
    entries: list[WatchEntry] = field(default_factory=list)
    remaining: dict[str, KeyValue] = field(default_factory=dict)  # vchannel -> its key
    malformed: list[MalformedWatch] = field(default_factory=list)


def parse_watch_info(key: str, value: bytes) -> ChannelWatchInfo:
    """Decode a watch info; MalformedValueError naming the key if it is not one, or if its
    vchannel differs from the key's last segment."""
    info = decode(key, value, ChannelWatchInfo)
    if vchannel_of(key) != info.vchan.channel_name:
        raise MalformedValueError(key, f"names vchannel {info.vchan.channel_name!r}, not the key's")
    return info


def vchannel_of(key: str) -> str:
    """The vchannel a `channelwatch/.../{vchannel}` key is about."""
    return key.rsplit("/", 1)[-1]


def list_watches(store: MetaStore) -> WatchListing:
    root = store.keys.channel_watch.prefix
    listing = WatchListing()
    for kv in store.list_prefix(root).items:
        node, _, vchannel = kv.key[len(root) :].partition("/")
        if node == REMAINING and vchannel and "/" not in vchannel:
            listing.remaining[vchannel] = kv
            continue
        try:
            if not node.isdigit() or not vchannel or "/" in vchannel:
                raise MalformedValueError(kv.key, "not channelwatch/{nodeID}/{vchannel}")
            listing.entries.append(WatchEntry(int(node), vchannel, parse_watch_info(kv.key, kv.value), kv))
        except MalformedValueError as exc:
            listing.malformed.append(MalformedWatch(node, vchannel, str(exc), kv))
    return listing
