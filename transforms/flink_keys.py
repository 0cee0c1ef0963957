"""Which parallel subtask Flink routes a keyed element to: Flink's own arithmetic on Beam's encoded key.

Beam's Flink runner keys a stage by the key's bytes (the key coder's nested encoding) wrapped in a
`FlinkKey`, whose hashCode is Guava's murmur3_128 of the bytes, as an int (Beam 2.62 wrapped them in a
java.nio.ByteBuffer and used its hashCode); Flink murmur-mixes that hashCode into one of maxParallelism key
groups, each owned by one subtask. The dispatch transform uses it to give each shard's element a key that
lands on a subtask of its own (tests/runners/test_flink_keys.py checks this against Beam's and Flink's own classes).
"""

from __future__ import annotations

import mmh3

_MASK = 0xFFFFFFFF


def _int32(x: int) -> int:
    x &= _MASK
    return x - (1 << 32) if x & 0x80000000 else x


def _rotl(x: int, bits: int) -> int:
    x &= _MASK
    return ((x << bits) | (x >> (32 - bits))) & _MASK


def flink_key_hash(data: bytes) -> int:
    """Beam's FlinkKey.hashCode(): Guava's `Hashing.murmur3_128().hashBytes(data).asInt()`, the first four
    bytes of the 128-bit hash (seed 0), little-endian."""
    return int.from_bytes(mmh3.hash_bytes(data, 0, True)[:4], "little", signed=True)


def murmur_hash(code: int) -> int:
    """org.apache.flink.util.MathUtils.murmurHash(int)."""
    code = _int32(code * 0xCC9E2D51)
    code = _int32(_rotl(code, 15))
    code = _int32(code * 0x1B873593)
    code = _int32(_rotl(code, 13))
    code = _int32(code * 5 + 0xE6546B64)
    code = _int32(code ^ 4)
    code = _bit_mix(code)
    if code >= 0:
        return code
    return -code if code != -(1 << 31) else 0


def _bit_mix(x: int) -> int:
    x &= _MASK
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK
    x ^= x >> 16
    return _int32(x)


def default_max_parallelism(parallelism: int) -> int:
    """Flink's KeyGroupRangeAssignment.computeDefaultMaxParallelism."""
    rounded = 1 << max(0, (parallelism + parallelism // 2 - 1).bit_length())
    return min(max(rounded, 128), 32768)


def operator_index(key: bytes, parallelism: int, max_parallelism: int | None = None) -> int:
    """The subtask (0..parallelism-1) Flink routes the encoded key `key` to."""
    max_parallelism = max_parallelism or default_max_parallelism(parallelism)
    key_group = murmur_hash(flink_key_hash(key)) % max_parallelism
    return key_group * parallelism // max_parallelism
