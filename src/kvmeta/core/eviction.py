"""The eviction seam: which STORED page a full pool gives up for a new key.

A ``Pool`` owns the pages, their keys and their leases; its *policy* owns only the order in
which STORED pages are given up. The pool tells the policy about every change to the set of
STORED pages and about every use of one, and asks it for a victim when a reserve (or a
journaled store's ``evict_ahead``) finds no FREE page. Keeping the order apart lets a new
policy (say, leaf-first for prefix chains) be written and tested without touching the pool's
state machine, its leases or its journal.

Plugging one in: subclass ``EvictionPolicy`` and pass the class (or any callable taking
``num_pages``) as ``Pool(..., policy=MyPolicy)``; ``Pool.from_lru`` and ``Pool.load`` take it
too. ``core.lru.LruPolicy`` is the default and the model to copy.

What a policy must guarantee, because the pool relies on it without checking:

- ``victim`` returns only a page it holds (a STORED page), never one whose read lease runs
  past ``now`` and never one in ``keep``; RESERVED and FREE pages never reach a policy, so a
  policy that follows ``added``/``removed`` cannot hand out a page a writer holds.
- ``victim`` and ``can_evict`` agree: whenever ``can_evict(n, steps, ...)`` answers True, n
  calls of ``victim`` with ``budget`` set to ``steps``, the same ``now``, ``keep`` and leases
  and no other change in between each find a page (vLLM's whole-batch reserve counts on it).
- Every method costs O(pages it is handed or returns) plus at most ``budget`` pages looked at
  and not taken: never O(pool) on a request path. ``load``, ``chain`` and ``copy`` are
  O(stored) and run at start-up, in snapshots and in checks only.
- ``chain`` is the policy's order, first victim first (an ``Order``: copies taken at memcpy
  speed on the event loop, walked later in a thread): a snapshot writes the STORED keys in
  that order and recovery hands them back to ``load`` in the same order, so a restarted pool
  evicts in the order the old one would have.

Time is passed in (``now``) and the read-lease deadlines are the pool's (``read_until``, one C
double per page), so a policy, like the pool, has no clock and no I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Container, Iterable, Mapping

__all__ = ["EvictionPolicy", "Order", "PolicyFactory", "chain_order"]


class EvictionPolicy(ABC):
    """The order in which a pool's STORED pages are evicted (module docstring)."""

    __slots__ = ("budget",)

    # Whether the order follows prefix chains: a reserve then keeps the page of the first
    # key's named parent from its own victims (``Pool.reserve``), which an order blind to
    # chains (LRU, here and in Redis) has no reason to.
    follows_chains = False

    def __init__(self) -> None:
        # Pages the calls of ``victim`` may still look at and not take (read-leased or kept),
        # in all: the pool sets it at the start of each reserve and ``evict_ahead`` (an
        # attribute, not a call: it costs nothing on the request path), so a reserve stays
        # O(request) when almost every page is being read.
        self.budget = 0

    @abstractmethod
    def resize(self, capacity: int) -> None:
        """Cover pages ``0..capacity-1`` (the pool's per-page arrays grew or were rolled back).

        Raises:
            MemoryError: the memory cannot be had; the policy is left as it was.
        """

    @abstractmethod
    def load(self, pages: list[int]) -> None:
        """Hold exactly ``pages`` (distinct, in range), given first victim first: recovery."""

    @abstractmethod
    def added(self, pages: list[int]) -> None:
        """``pages`` (one or more) became STORED, in this order (a confirm's commits)."""

    @abstractmethod
    def used(self, pages: Iterable[int | None]) -> None:
        """``pages`` (held ones; None entries are skipped) were read or reserved again, in this
        order. A reserve reports a hit before it looks for its next victim."""

    def asked(  # noqa: B027 - optional hook
        self, keys: list[str], found: list[bool], stored: Mapping[str, int]
    ) -> None:
        """An ``exists`` of ``keys`` found ``found`` (``stored``: the pool's key -> page of the
        STORED keys, read-only). A policy that orders by position in a request (``core.prefix``)
        reads it, others need not."""

    def reserved(  # noqa: B027 - optional hook
        self, keys: list[str], out: list[tuple[bool, int]], plain: bool, parent: int = -1
    ) -> None:
        """A reserve of ``keys`` answered ``out`` (per key, in the request's order: ``(True,
        page)`` for a STORED key, ``(False, page)`` for a page to write, ``(False, -1)`` for
        none); ``plain``: every key got a new page of its own; ``parent``: the held page of the
        key the request named as the first key's prefix (-1: none named, or not stored). One
        call per reserve, after its victims were taken; a policy that orders by position in a
        request (``core.prefix``) reads it, others need not."""

    def stepped_over(  # noqa: B027 - optional hook
        self,
        count: int,
        steps: int,
        now: float,
        keep: Container[int],
        read_until: array[float],
    ) -> None:
        """A whole batch short of ``count`` pages was refused (``can_evict`` said no): treat
        the read-leased pages its victims would have stepped over with ``steps``, as they
        would (moved warm: they are being read), and take nothing. A policy whose victims
        step over nothing need not."""

    def unreserved(self, page: int) -> None:  # noqa: B027 - optional hook
        """``page``'s reservation ended without a confirm (released or expired): whatever
        ``reserved`` noted for it is void."""

    @abstractmethod
    def removed(self, page: int) -> None:
        """``page`` stopped being STORED for another reason than ``victim`` (a delete)."""

    @abstractmethod
    def clear(self) -> None:
        """Every page is gone (the pool was cleared)."""

    @abstractmethod
    def victim(self, now: float, keep: Container[int], read_until: array[float]) -> int:
        """Give up one held page, not in ``keep`` and with ``read_until[page] <= now``, and
        return it (it is no longer held); -1 when none is found within ``budget``."""

    @abstractmethod
    def can_evict(
        self, count: int, steps: int, now: float, keep: Container[int], read_until: array[float]
    ) -> bool:
        """Whether ``count`` calls of ``victim`` with ``budget`` at ``steps`` would each find a
        page; changes nothing."""

    @abstractmethod
    def chain(self) -> Order:
        """The held pages in order, first victim first, as copies the caller may keep and walk
        later (``Order.pages``), so a snapshot takes them at memcpy speed and walks them
        elsewhere."""

    @abstractmethod
    def copy(self) -> EvictionPolicy:
        """An independent copy, for checking the pool's invariants off the event loop."""

    @abstractmethod
    def problem(self, capacity: int) -> str | None:
        """What is wrong with the policy's own structures (None: nothing) for a pool whose
        per-page arrays cover ``capacity`` pages. Which pages it holds is checked apart, against
        the STORED pages, by walking ``chain``."""


# What ``Pool(policy=...)`` takes: makes a pool's policy from its ``num_pages`` (a class will do).
PolicyFactory = Callable[[int], EvictionPolicy]


class Order:
    """A victim order copied out of a policy: next-links (``nxt[page]``, -1 after the last)
    from ``head`` (-1: none). A policy whose order is not one list subclasses it."""

    __slots__ = ("nxt", "head")

    def __init__(self, nxt: array[int], head: int) -> None:
        self.nxt, self.head = nxt, head

    def pages(self) -> array[int]:
        """The pages, first victim first (at most one per page number: a cycle is cut). O(held),
        in a loop of its own: a snapshot's thread runs it at 10^6 pages."""
        out = array(self.nxt.typecode)
        add, nxt = out.append, self.nxt
        page = self.head
        for _ in range(len(nxt)):
            if page == -1:
                break
            add(page)
            page = nxt[page]
        return out


def chain_order(page_key: list[str | None], order: Order) -> tuple[list[str], array[int]]:
    """STORED keys and their pages, first victim first, from copies of the page->key table and
    of a policy's ``chain``: what a snapshot writes and recovery loads."""
    pages = order.pages()
    keys = [page_key[page] for page in pages]
    assert None not in keys, "a policy's order names a page without a key"
    return keys, pages  # type: ignore[return-value]  # no None: checked above
