"""Stats logs: primary-key min/max and a bloom filter over the pks of one binlog.

Milvus keeps a bloom filter per segment so deletes and upserts can find which
segments may hold a pk without reading them. The file is JSON (readable by any
engine): {"v", "entries", "pk_min", "pk_max", "m", "k", "bits": base64}; for VarChar
pks, `pk_min`/`pk_max` are strings and the bloom filter's keys are the strings' 64-bit
SipHash (pandas' `hash_array`, fixed key: the same in every process and release).
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass

import numpy as np

from vchan_assets.fields import Pk, hash_keys, key_array

FALSE_POSITIVE_RATE = 0.001
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


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

    @classmethod
    def build(cls, pks: np.ndarray, fpr: float = FALSE_POSITIVE_RATE) -> PkStats:
        """Stats of `pks`: int64, or strings (VarChar pks, as an object or str array)."""
        pks = key_array(pks)
        n = max(int(len(pks)), 1)
        needed = max(64, int(math.ceil(-n * math.log(fpr) / (math.log(2) ** 2))))
        k = max(1, round(needed / n * math.log(2)))
        m = 1 << (needed - 1).bit_length()  # a power of two: positions by mask, not modulo
        # One flag per bit, packed at the end (bit i is bit i % 8 of byte i // 8): an indexed
        # store per position instead of np.bitwise_or.at, several times slower per pk.
        flags = np.zeros(m, dtype=bool)
        for idx in _positions(pks, m, k):
            flags[idx.astype(np.int64)] = True
        bitset = np.packbits(flags, bitorder="little")
        return cls(
            entries=int(len(pks)),
            pk_min=_bound(pks.min()) if len(pks) else 0,
            pk_max=_bound(pks.max()) if len(pks) else 0,
            m=m,
            k=k,
            bits=bitset.tobytes(),
        )

    def might_contain(self, pks: np.ndarray) -> np.ndarray:
        """Per pk: False means certainly absent; True means possibly present."""
        pks = key_array(pks)
        if not self.entries or not len(pks):
            return np.zeros(len(pks), dtype=bool)
        result = (pks >= self.pk_min) & (pks <= self.pk_max)
        bitset = np.frombuffer(self.bits, dtype=np.uint8)
        for idx in _positions(pks, self.m, self.k):
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
            }
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> PkStats:
        d = json.loads(raw)
        return cls(d["entries"], d["pk_min"], d["pk_max"], d["m"], d["k"], base64.b64decode(d["bits"]))


def _positions(pks: np.ndarray, m: int, k: int) -> list[np.ndarray]:
    # Double hashing: h1 + i*h2 (Kirsch-Mitzenmacher) gives k independent-enough positions.
    keys = hash_keys(pks)
    h1 = _mix(keys, 0)
    h2 = _mix(keys, 1) | np.uint64(1)
    mask = np.uint64(m - 1)
    with np.errstate(over="ignore"):
        return [(h1 + np.uint64(i) * h2) & mask for i in range(k)]
