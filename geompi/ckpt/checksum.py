"""fletcher32, exactly as HDF5's filter computes it, fast enough for large chunks."""

from __future__ import annotations

import numpy as np

from geompi.ckpt.format import _CK_BLOCK_BYTES

#
# HDF5 sums big-endian 16-bit words w_0..w_{n-1} (an odd last byte is the high byte of a word):
# sum1 = sum(w_j), sum2 = sum((n - j) * w_j), each folded into 16 bits with end-around carry,
# and returns (sum2 << 16) | sum1. Folding keeps a value mod 65535, never lets a positive sum
# reach 0, and (HDF5 reduces every 360 words) never overflows, so each half is 0 for all-zero
# data and otherwise ((sum - 1) mod 65535) + 1. Since 65536 = 1 (mod 65535), a big-endian word
# is 256 times its little-endian reading, so the words can be read natively. The sums are done
# in float32 over blocks of 256 x 256 words, where every partial sum is an integer below 2**24
# and therefore exact (BLAS matrix-vector products, whatever their order). numpy, not torch:
# torch's threads crawl when MPI ranks already fill the cores.


_ONES = np.ones(256, np.float32)


def _fletcher32_padded(buf: np.ndarray, nbytes: int) -> int:
    """fletcher32 of buf[:nbytes]; len(buf) is a multiple of _CK_BLOCK_BYTES, zero after nbytes."""
    n = (nbytes + 1) // 2
    n_padded = buf.size // 2
    words = buf.view(np.uint16).astype(np.float32).reshape(-1, 256, 256)
    rows = (words @ _ONES).astype(np.int64)  # [K, 256]: sum of each row of 256 words
    cols = (_ONES @ words).astype(np.int64)  # [K, 256]: sum of each column of a block
    blocks = rows.sum(axis=1)  # [K]
    t1 = int(blocks.sum())
    if t1 == 0:
        return 0
    k = blocks.size
    idx = np.arange(256, dtype=np.int64)
    # sum2 = sum over words of (words from it to the end) * word; 65536 = 1 (mod 65535)
    weights = (k - np.arange(k, dtype=np.int64)) % 65535
    t2 = (
        int((weights * (blocks % 65535)).sum())
        - 256 * int((rows @ idx).sum())
        - int((cols @ idx).sum())
        - (n_padded - n) * t1  # the zero padding added its length times sum1 to sum2
    )
    s1 = (t1 * 256) % 65535 or 65535
    s2 = (t2 * 256) % 65535 or 65535
    return (s2 << 16) | s1


def _fletcher32(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """fletcher32 of any bytes, as HDF5's fletcher32 filter computes it."""
    raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    padded = max(_CK_BLOCK_BYTES, -(-raw.size // _CK_BLOCK_BYTES) * _CK_BLOCK_BYTES)
    buf = np.zeros(padded, np.uint8)
    buf[: raw.size] = raw
    return _fletcher32_padded(buf, raw.size)
