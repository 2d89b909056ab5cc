"""Content addresses of pages: the page-hash chain of a prefix (pure computation).

A page's hash covers everything before it: ``page_hash(parent, namespace, tokens)`` =
SHA-256 of the previous page's hash, the namespace (``extra_key``, ``cache_salt``) and the
page's token ids. Two servers that computed the same prefix in the same namespace get the same
chain, so the hash names the KV across servers (the cluster store's keys) and across restarts
(the NVMe index's records). Requests with different salts never share a hash. SHA-256, as
SGLang's own storage keys (``mem_cache/utils.py::get_hash_str``): a forged collision would let
one tenant read another's KV.

A cluster-store key is ``key_prefix + page hash (hex)``; the prefix names the KV fingerprint
(model, dtype, page size, layout, TP rank and size, ``hiradix.persistence.fingerprint``), so a
different model or page size on the same store never reuses a key.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Optional, Sequence

from hiradix.core.node import TreeNode

HASH_NAME = "sha256-v1"  # goes into the KV fingerprint: a change invalidates persisted records
ROOT_HASH = b""  # the "parent hash" of a prefix's first page


def page_hash(parent_hash: bytes, namespace: Optional[Sequence], tokens: Sequence[int]) -> bytes:
    """32-byte identity of a page given its prefix."""
    h = hashlib.sha256(parent_hash)
    h.update(json.dumps(list(namespace) if namespace is not None else None, separators=(",", ":")).encode())
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def page_tokens(tokens: Sequence[int], page_size: int) -> list[Sequence[int]]:
    """``tokens`` cut into whole pages."""
    return [tokens[i : i + page_size] for i in range(0, len(tokens) - len(tokens) % page_size, page_size)]


def chain(parent_hash: bytes, namespace: Optional[Sequence], tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Hashes of the whole pages of ``tokens`` following a prefix whose last page hashed to ``parent_hash``."""
    out = []
    for page in page_tokens(tokens, page_size):
        parent_hash = page_hash(parent_hash, namespace, page)
        out.append(parent_hash)
    return out


def prefix_hash(root: TreeNode, node: TreeNode, page_size: int) -> bytes:
    """Hash of the prefix through ``node``'s last page (``ROOT_HASH`` for the root).

    Cached per node (``TreeNode.chain_hash``): only the pages below the nearest cached ancestor
    are hashed, and the hashes found on the way are cached. A split leaves the cache on the lower
    node (same last page) and none on the new upper one.
    """
    above = []
    while node is not root and node.chain_hash is None:
        above.append(node)
        node = node.parent
    h = ROOT_HASH if node is root else node.chain_hash
    for ancestor in reversed(above):
        hashes = chain(h, ancestor.namespace, ancestor.tokens, page_size)
        ancestor.chain_hash = h = hashes[-1]
    return h


def node_hashes(root: TreeNode, node: TreeNode, page_size: int) -> list[bytes]:
    """Hash of each page of ``node``, in order (its last one is cached as ``chain_hash``)."""
    parent = prefix_hash(root, node.parent, page_size)
    hashes = chain(parent, node.namespace, node.tokens, page_size)
    node.chain_hash = hashes[-1]
    return hashes
