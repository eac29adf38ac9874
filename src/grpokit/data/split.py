"""The one split every task uses: a fixed hash of a question's text puts it on the held-out, the
validation or the training side, so the split never depends on seeds, order or the data's size.
Positions below the held-out share are held out (the numbers a run reports); the next
validation share is validation (what settings are chosen on); the rest is training."""

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


def split_of(key: str, heldout: float, validation: float = 0.0) -> str:
    """"heldout", "validation" or "train": where the question `key` falls when a share `heldout` of
    all questions is held out and the next share `validation` validates."""
    position = heldout_position(key)
    if position < heldout:
        return "heldout"
    # rounded: 0.1 + 0.05 must be the float 0.15, the position of a question at exactly 15%
    return "validation" if position < round(heldout + validation, 12) else "train"
