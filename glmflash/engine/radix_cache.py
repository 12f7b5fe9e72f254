"""Prefix cache for the hybrid model (no torch): a radix tree over token ids whose nodes hold
cache pages, shared by reference count, and may hold a state snapshot taken at their end.

A node covers key positions `[start, end)` of every prompt that passes through it.
- Pages: a node holds the pages its span touches, page indices `first_page ..`, except a first
  page that is the very page its path already holds at that index (a sequence extending its own
  earlier node mid-page). Page index i of a prefix is the page of the deepest node on the path
  that holds index i; that page is valid up to the node's end (a later position of it may have
  been written by a sequence that went on; a reader copies a partial last page).
- Snapshots: the KDA recurrent and conv state and the indexer tail cannot be rebuilt from pages,
  so a prefix is reusable only up to a node holding a snapshot (a tombstone has none): a match
  is the deepest such node on the path.
- Locks: a node is locked while a live sequence's path runs through it (a lock covers the node
  and its ancestors). NOTE: an unlocked node's pages are held by the tree alone, so evicting it
  frees exactly `len(pages)` pages; `num_evictable_pages` counts them.
- Two LRU lists: pages leaf-first by last access (tombstone leaves, which no match can use,
  first); snapshots by their own recency, any that no pending copy reads or writes. A match
  touches its path root-first, so the snapshots nearest the root age first.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple, Protocol

import numpy as np


class PageRefs(Protocol):
    def ref(self, page: int) -> None: ...

    def unref(self, page: int) -> None: ...


class Node:
    __slots__ = ("parent", "key", "start", "children", "first_page", "pages", "snapshot",
                 "lock_ref", "last_access")

    def __init__(self, parent: Node | None, key: array, start: int, first_page: int,
                 pages: list[int]) -> None:
        self.parent = parent
        self.key = key
        """Token keys of positions `[start, end)`."""
        self.start = start
        self.children: dict[int, Node] = {}
        """Children by the first key of their span."""
        self.first_page = first_page
        self.pages = pages
        """Pages of page indices `first_page .. first_page + len(pages) - 1`."""
        self.snapshot: int | None = None
        """Snapshot slot with the state after position `end - 1`."""
        self.lock_ref = 0
        self.last_access = 0

    @property
    def end(self) -> int:
        return self.start + len(self.key)


class PrefixHit(NamedTuple):
    node: Node
    """The deepest node on the path with a snapshot; the hit ends at its end."""
    num_tokens: int
    pages: list[int]
    """Page of each page index covering the hit (the last one partial if not page-aligned)."""
    snapshot: int


class RadixCache:
    def __init__(self, pages: PageRefs, page_size: int, num_snapshots: int) -> None:
        self.page_refs = pages
        self.page_size = page_size
        self.num_snapshots = num_snapshots
        self.root = Node(None, array("q"), 0, 0, [])
        self.nodes: set[Node] = set()
        self.free_snapshots = list(range(num_snapshots - 1, -1, -1))
        self.snapshot_lru: OrderedDict[Node, None] = OrderedDict()
        self.pending_snapshots: set[int] = set()
        """Snapshots that copies not yet handed to the runner read or write."""
        self._freed_while_pending: list[int] = []
        self.num_evictable_pages = 0
        self.num_cached_pages = 0
        self._clock = itertools.count(1)

    # Lookup.
    def match(self, key: array, limit: int) -> PrefixHit | None:
        """The longest prefix of `key[:limit]` ending at a node with a snapshot (no lock)."""
        node, pos, path, best = self.root, 0, [], 0
        while pos < limit:
            child = node.children.get(key[pos])
            if child is None or child.end > limit or child.key != key[pos:child.end]:
                break
            node, pos = child, child.end
            path.append(node)
            if node.snapshot is not None:
                best = len(path)
        if not best:
            return None
        path = path[:best]
        self._touch(path)
        hit = path[-1]
        return PrefixHit(hit, hit.end, self._path_pages(path, hit.end), hit.snapshot)

    def _path_pages(self, path: list[Node], num_tokens: int) -> list[int]:
        pages: list[int | None] = [None] * -(-num_tokens // self.page_size)
        for node in path:
            pages[node.first_page: node.first_page + len(node.pages)] = node.pages
        assert None not in pages, "a page index of the path has no page"
        return pages

    def _touch(self, path: Iterable[Node]) -> None:
        for node in path:
            node.last_access = next(self._clock)
            if node.snapshot is not None:
                self.snapshot_lru.move_to_end(node)

    # Locks: a sequence locks the deepest node it uses, and so its whole path.
    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.num_evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0
            if node.lock_ref == 0:
                self.num_evictable_pages += len(node.pages)
            node = node.parent

    # Insertion.
    def insert(self, below: Node, key: array, end: int, seq_pages: list[int]) -> Node:
        """The node ending at `end` on the path of `key[:end]`, made if needed, below `below`
        (a node `key` already passes through); new nodes adopt the sequence's pages."""
        node, pos = below, below.end
        assert pos <= end
        while pos < end:
            child = node.children.get(key[pos])
            if child is None:
                return self._add_leaf(node, key[pos:end], seq_pages)
            common = _common_prefix(child.key, key, pos, end)
            if common < len(child.key):
                child = self._split(child, common)
            node, pos = child, child.end
            node.last_access = next(self._clock)
        return node

    def _add_leaf(self, parent: Node, key: array, seq_pages: list[int]) -> Node:
        start, size = parent.end, self.page_size
        first = start // size
        if start % size and self._page_at(parent, first) == seq_pages[first]:
            first += 1
        pages = seq_pages[first: (start + len(key) - 1) // size + 1]
        for page in pages:
            self.page_refs.ref(page)
        node = Node(parent, key, start, first, pages)
        node.last_access = next(self._clock)
        parent.children[key[0]] = node
        self.nodes.add(node)
        self.num_evictable_pages += len(pages)
        self.num_cached_pages += len(pages)
        return node

    def _page_at(self, node: Node, index: int) -> int | None:
        """The page that the path ending at `node` holds at page `index`, if any."""
        while node is not self.root and node.end > index * self.page_size:
            if node.first_page <= index < node.first_page + len(node.pages):
                return node.pages[index - node.first_page]
            node = node.parent
        return None

    def _split(self, node: Node, offset: int) -> Node:
        """Cut `node` after `offset` keys; returns the new upper part (the node object keeps
        the lower part, its end, snapshot and children)."""
        cut = (node.start + offset - 1) // self.page_size + 1
        num_upper = max(0, min(len(node.pages), cut - node.first_page))
        upper = Node(node.parent, node.key[:offset], node.start, node.first_page,
                     node.pages[:num_upper])
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.parent.children[upper.key[0]] = upper
        node.key, node.start = node.key[offset:], node.start + offset
        node.pages, node.first_page = node.pages[num_upper:], node.first_page + num_upper
        node.parent = upper
        upper.children[node.key[0]] = node
        self.nodes.add(upper)
        return upper

    # Snapshots.
    def take_snapshot(self, node: Node) -> int | None:
        """A snapshot slot for the state at `node`'s end, evicting the least recently used
        snapshot if none is free; None if the node has one already or none can be evicted."""
        if node.snapshot is not None:
            self.snapshot_lru.move_to_end(node)
            return None
        if not self.free_snapshots and not self._evict_snapshot():
            return None
        node.snapshot = self.free_snapshots.pop()
        self.snapshot_lru[node] = None
        self.pending_snapshots.add(node.snapshot)
        return node.snapshot

    def _evict_snapshot(self) -> bool:
        for node in self.snapshot_lru:
            if node.snapshot not in self.pending_snapshots:
                self._drop_snapshot(node)
                return True
        return False

    def _drop_snapshot(self, node: Node) -> None:
        if node.snapshot in self.pending_snapshots:
            self._freed_while_pending.append(node.snapshot)
        else:
            self.free_snapshots.append(node.snapshot)
        del self.snapshot_lru[node]
        node.snapshot = None

    def forget_snapshots(self, snapshots: set[int]) -> None:
        """Take these snapshots off their nodes (copies that may never have been made)."""
        for node in [n for n in self.snapshot_lru if n.snapshot in snapshots]:
            self._drop_snapshot(node)

    def clear_pending(self) -> None:
        """The copies logged so far went to the runner, which applies them in order."""
        self.pending_snapshots.clear()
        self.free_snapshots.extend(self._freed_while_pending)
        self._freed_while_pending.clear()

    # Eviction.
    def evict_pages(self, num_pages: int) -> int:
        """Evict unlocked leaves, least useful first, until `num_pages` pages are freed."""
        heap = [_leaf_order(n) for n in self.nodes if not n.children and not n.lock_ref]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            node = heapq.heappop(heap)[-1]
            freed += len(node.pages)
            parent = node.parent
            self._remove_leaf(node)
            if parent is not self.root and not parent.children and not parent.lock_ref:
                heapq.heappush(heap, _leaf_order(parent))
        return freed

    def _remove_leaf(self, node: Node) -> None:
        assert not node.children and not node.lock_ref
        for page in node.pages:
            self.page_refs.unref(page)
        self.num_evictable_pages -= len(node.pages)
        self.num_cached_pages -= len(node.pages)
        if node.snapshot is not None:
            self._drop_snapshot(node)
        del node.parent.children[node.key[0]]
        self.nodes.remove(node)

    def page_holders(self) -> dict[int, int]:
        """page -> number of nodes holding it (for the cache manager's reference check)."""
        held: dict[int, int] = {}
        for node in self.nodes:
            for page in node.pages:
                held[page] = held.get(page, 0) + 1
        return held


def _leaf_order(node: Node) -> tuple[bool, int, int, Node]:
    return node.snapshot is not None, node.last_access, id(node), node


def _common_prefix(node_key: array, key: array, pos: int, end: int) -> int:
    """Length of the common prefix of `node_key` and `key[pos:end]`."""
    n = min(len(node_key), end - pos)
    if node_key[:n] == key[pos: pos + n]:
        return n
    a = np.frombuffer(node_key, dtype=np.int64, count=n)
    b = np.frombuffer(key, dtype=np.int64, count=n, offset=pos * key.itemsize)
    return int(np.argmax(a != b))


def check_tree(cache: RadixCache, locked: list[Node]) -> None:
    """Structure, locks, counters and snapshot ownership of `cache`; `locked` holds the node
    each live sequence locks."""
    reachable, stack = set(), [cache.root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node and child.key[0] == first and len(child.key) > 0
            assert child.start == node.end, "a child does not start where its parent ends"
            reachable.add(child)
            stack.append(child)
    assert reachable == cache.nodes, "the node set differs from the tree"
    expected = dict.fromkeys(cache.nodes, 0)
    for node in locked:
        while node is not cache.root:
            expected[node] += 1
            node = node.parent
    size = cache.page_size
    for node in cache.nodes:
        assert node.lock_ref == expected[node], "a lock count differs from the live sequences"
        assert node.start // size <= node.first_page
        assert node.first_page + len(node.pages) - 1 <= (node.end - 1) // size
        path = []
        walk = node
        while walk is not cache.root:
            path.append(walk)
            walk = walk.parent
        cache._path_pages(path[::-1], node.end)
    unlocked = sum(len(n.pages) for n in cache.nodes if not n.lock_ref)
    assert cache.num_evictable_pages == unlocked, "evictable page count drifted"
    assert cache.num_cached_pages == sum(len(n.pages) for n in cache.nodes)
    held = [n.snapshot for n in cache.nodes if n.snapshot is not None]
    assert set(cache.snapshot_lru) == {n for n in cache.nodes if n.snapshot is not None}
    slots = held + cache.free_snapshots + cache._freed_while_pending
    assert sorted(slots) == list(range(cache.num_snapshots)), "snapshot leaked or shared"
