"""The one held-out split every task uses: a fixed hash of a question's text puts it on the
training or the held-out side, so the split never depends on seeds, order or the data's size."""

from __future__ import annotations

import zlib

# crc32's last two decimal digits give the percent, its next six digits the position within it,
# so a whole-percent fraction splits exactly as "crc32 % 100 < percent" does.
_FINE = 10**6


def heldout_position(key: str) -> float:
    """Where `key` falls in [0, 1): the held-out side of a split at fraction f is position < f."""
    crc = zlib.crc32(key.encode())
    return (crc % 100 + (crc // 100) % _FINE / _FINE) / 100


def is_heldout(key: str, fraction: float) -> bool:
    """Whether the question `key` is held out when a share `fraction` of all questions is."""
    return heldout_position(key) < fraction
