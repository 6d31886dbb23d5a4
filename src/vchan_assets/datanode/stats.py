"""Stats logs: primary-key min/max and a bloom filter over the pks of one binlog.

Milvus keeps a bloom filter per segment so deletes and upserts can find which
segments may hold a pk without reading them. The file is JSON (readable by any
engine): {"v", "entries", "pk_min", "pk_max", "m", "k", "bits": base64}; for VarChar
pks, `pk_min`/`pk_max` are strings and the bloom filter's keys are 64-bit hashes of the
strings, named by `"hash"`:

- `"words64"` (written since 2026-11-29): each string's UTF-8 bytes as little-endian 8-byte
  words (the last zero-padded), chained through splitmix64's finaliser, then its length;
  computed from the Arrow buffers, with no Python object per key (`text_keys`);
- absent: the SipHash of pandas' `hash_array` (fixed key), what the files written before hold.

int64 pks are their own keys (no `"hash"`).
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.fields import Pk, hash_keys, key_array

FALSE_POSITIVE_RATE = 0.001
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
SIPHASH = "siphash"  # VarChar keys of the stats logs written before "words64"
WORDS64 = "words64"
# The bytes of index one `text_keys` chunk gathers at most (its rows times its longest key).
_GATHER_BYTES = 1 << 22


def _mix(x: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 finaliser: a fast, well-spread 64-bit hash of int64 keys."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15 * (seed + 1) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _bound(value: object) -> Pk:
    return value if isinstance(value, str) else int(value)  # type: ignore[call-overload]


@dataclass(frozen=True)
class PkStats:
    entries: int
    pk_min: Pk
    pk_max: Pk
    m: int  # bits
    k: int  # hash functions
    bits: bytes
    hash: str = SIPHASH  # how VarChar keys are hashed (int64 keys: themselves)

    @classmethod
    def build(cls, pks: np.ndarray | pa.Array | pa.ChunkedArray, fpr: float = FALSE_POSITIVE_RATE) -> PkStats:
        """Stats of `pks`: int64, or VarChar (an Arrow string column: hashed from its buffers;
        as an object or str array: converted to one)."""
        text = _text(pks)
        if text is None:
            keys = key_array(pks.to_numpy() if isinstance(pks, pa.Array | pa.ChunkedArray) else pks)
            bounds = (_bound(keys.min()), _bound(keys.max())) if len(keys) else (0, 0)
            hashed = keys
        else:
            found = pc.min_max(text)
            bounds = (found["min"].as_py(), found["max"].as_py()) if len(text) else (0, 0)
            hashed = text_keys(text)
        m, k = bloom_size(max(int(len(hashed)), 1), fpr)
        # One flag per bit, packed at the end (bit i is bit i % 8 of byte i // 8): an indexed
        # store per position instead of np.bitwise_or.at, several times slower per pk.
        flags = np.zeros(m, dtype=bool)
        for idx in _positions(hash_keys(hashed), m, k):
            flags[idx.astype(np.int64)] = True
        bitset = np.packbits(flags, bitorder="little")
        return cls(
            entries=int(len(hashed)),
            pk_min=bounds[0],
            pk_max=bounds[1],
            m=m,
            k=k,
            bits=bitset.tobytes(),
            hash=SIPHASH if text is None else WORDS64,
        )

    def might_contain(self, pks: np.ndarray) -> np.ndarray:
        """Per pk: False means certainly absent; True means possibly present."""
        pks = key_array(pks)
        if not self.entries or not len(pks):
            return np.zeros(len(pks), dtype=bool)
        result = (pks >= self.pk_min) & (pks <= self.pk_max)
        text = pks.dtype == object and self.hash == WORDS64
        keys = text_keys(pa.array(pks.tolist(), pa.string())) if text else hash_keys(pks)
        bitset = np.frombuffer(self.bits, dtype=np.uint8)
        for idx in _positions(keys, self.m, self.k):
            byte = bitset[(idx >> np.uint64(3)).astype(np.int64)]
            result &= (byte >> (idx & np.uint64(7)).astype(np.uint8)) & 1 == 1
        return result

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "v": 1,
                "entries": self.entries,
                "pk_min": self.pk_min,
                "pk_max": self.pk_max,
                "m": self.m,
                "k": self.k,
                "bits": base64.b64encode(self.bits).decode(),
                **({"hash": self.hash} if self.hash != SIPHASH else {}),
            }
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> PkStats:
        d = json.loads(raw)
        return cls(
            d["entries"],
            d["pk_min"],
            d["pk_max"],
            d["m"],
            d["k"],
            base64.b64decode(d["bits"]),
            d.get("hash", SIPHASH),
        )


def bloom_size(n: int, fpr: float = FALSE_POSITIVE_RATE) -> tuple[int, int]:
    """(m bits, k hash functions) of a bloom filter over `n` keys at false-positive rate
    `fpr`. m is the optimal size rounded up to a power of two (positions by mask, not
    modulo), so it has up to twice the bits the rate needs; k is then the fewest hash
    functions that meet the rate in those bits (4-6 for most n, not the 10 of the unrounded
    size): fewer positions to compute and set, at the same false-positive bound. A file
    states its own m and k; readers use them."""
    needed = max(64, math.ceil(-n * math.log(fpr) / (math.log(2) ** 2)))
    m = 1 << (needed - 1).bit_length()
    most = max(1, round(needed / n * math.log(2)))  # the optimum of the unrounded size
    k = next((k for k in range(1, most) if (1 - math.exp(-k * n / m)) ** k <= fpr), most)
    return m, k


def _positions(keys: np.ndarray, m: int, k: int) -> list[np.ndarray]:
    """The k bit positions of each int64 key."""
    # Double hashing: h1 + i*h2 (Kirsch-Mitzenmacher) gives k independent-enough positions.
    h1 = _mix(keys, 0)
    h2 = _mix(keys, 1) | np.uint64(1)
    mask = np.uint64(m - 1)
    with np.errstate(over="ignore"):
        return [(h1 + np.uint64(i) * h2) & mask for i in range(k)]


def _text(pks: np.ndarray | pa.Array | pa.ChunkedArray) -> pa.Array | None:
    """VarChar pks as one Arrow string array (None: int64 pks, left as they are)."""
    if isinstance(pks, pa.Array | pa.ChunkedArray):
        if pa.types.is_integer(pks.type):
            return None
        return pks.combine_chunks() if isinstance(pks, pa.ChunkedArray) else pks
    if pks.dtype.kind in "iu":
        return None
    return pa.array(pks.tolist(), pa.large_string())


def text_keys(text: pa.Array) -> np.ndarray:
    """The `words64` hash of each string, as int64, from the Arrow buffers (no Python
    object per string). Rows are taken by length, so each group's keys are one
    (rows, length) block of bytes: a reshape when they lie back to back (ids, UUIDs), one
    gather otherwise; its words are mixed a column at a time."""
    text = text.cast(pa.large_string())
    n = len(text)
    if not n:
        return np.empty(0, dtype=np.int64)
    if text.null_count:
        raise ValueError("a primary key is null")
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int64, count=text.offset + n + 1)[text.offset :]
    values = text.buffers()[2]
    data = (
        np.frombuffer(values, dtype=np.uint8) if values is not None and values.size else np.zeros(1, np.uint8)
    )
    lengths = np.diff(offsets)
    out = np.empty(n, dtype=np.uint64)
    order = np.argsort(lengths, kind="stable")
    bounds = [0, *(np.flatnonzero(np.diff(lengths[order])) + 1).tolist(), n]
    for first, last in zip(bounds, bounds[1:], strict=False):
        length = int(lengths[order[first]])
        step = max(1, _GATHER_BYTES // max(length, 8))
        for at in range(first, last, step):
            rows = order[at : min(last, at + step)]
            out[rows] = _words64(data, offsets[rows], length)
    return out.view(np.int64)


def _words64(data: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """The hashes of keys of one `length` starting at `starts`."""
    words = (length + 7) // 8
    matrix = np.zeros((len(starts), max(words, 1) * 8), dtype=np.uint8)
    first = int(starts[0])
    if len(starts) == 1 or (np.diff(starts) == length).all():
        # Back to back (ids, UUIDs): a reshape, no gather.
        matrix[:, :length] = data[first : first + length * len(starts)].reshape(len(starts), length)
    elif length:
        # A window of `length` bytes at each byte of the data: one row copied per key.
        matrix[:, :length] = np.lib.stride_tricks.sliding_window_view(data, length)[starts]
    columns = matrix.view("<u8")
    h = np.zeros(len(starts), dtype=np.uint64)
    for j in range(words):
        h = _mix(h ^ columns[:, j], j)
    return _mix(h ^ np.uint64(length), -1)
