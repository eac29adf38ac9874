"""derive_seed: every derived seed (a request's, a process's, a tool round's, an evaluation
prompt's) comes from one function, and its values never change (a resumed or repeated run samples
the same completions)."""

import hashlib

from grpokit.seeds import derive_seed


def test_derive_seed_is_blake2b_of_the_parts_joined_by_slashes():
    expected = int.from_bytes(hashlib.blake2b(b"0/3/1/2", digest_size=4).digest(), "little")
    assert derive_seed(0, 3, 1, 2) == expected


def test_derived_seeds_keep_their_values():
    # written down once: a change here changes every run's samples
    assert [derive_seed(0, 3, 1, 2), derive_seed(7, "rank", 1), derive_seed(5, "round2")] == [3542001175, 1832517138,
                                                                                         3807391869]


def test_derived_seeds_are_32_bit_and_differ_by_part():
    seeds = {derive_seed(1, step, p) for step in range(20) for p in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**32 for s in seeds)
