"""Seeds derived from other seeds: a request's, a process's, a tool round's. Each comes from a
stable hash of its parts, so it does not depend on what else shares its batch or its process."""

from __future__ import annotations

import hashlib


def derive_seed(*parts) -> int:
    """A 32-bit seed from `parts` joined by "/" (blake2b, stable across runs and machines)."""
    text = "/".join(str(part) for part in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")
