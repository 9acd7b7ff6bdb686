"""The keys of a prompt's KV blocks, as the worker's prefix cache registers them and the API routes by them.

A full block of `block_size` tokens is keyed by a hash of its tokens and of its parent's key, so a key
names the block's whole prefix; the chain starts from the request's cache salt, so requests with
different salts never share (or route by) a block. Pure, without torch: the API imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def salt_seed(salt: str | None) -> bytes:
    return b"" if salt is None else b"salt:" + salt.encode()


def block_keys(tokens: Sequence[int], block_size: int, salt: str | None, known: Sequence[bytes] = ()) -> list[bytes]:
    """The keys of the full blocks of `tokens`: `known` (the keys of its first blocks, already computed)
    extended over the rest."""
    keys = list(known)
    parent = keys[-1] if keys else salt_seed(salt)
    for index in range(len(keys), len(tokens) // block_size):
        chunk = tokens[index * block_size : (index + 1) * block_size]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b",".join(str(t).encode() for t in chunk))
        parent = digest.digest()
        keys.append(parent)
    return keys
