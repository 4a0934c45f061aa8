"""GetPreferredAllocation: which of the available devices to give a container, by interconnect quality.

The node's topology is read once (from discovery's Inventory) into an immutable `Topology` of pair
scores; every kubelet call then only does arithmetic on it, never NVML (the reference plugin re-reads
NVML per call and takes seconds on 8-GPU nodes), and concurrent calls share it safely.

Scores. Two physical GPUs score `nvlinks * 100 + PCIe closeness`, closeness being INTERNAL 60, SINGLE
50, MULTIPLE 40, HOSTBRIDGE 30, NODE 20, SYSTEM 10, unknown 0: one NVLink link outweighs any PCIe
difference of that pair. Two devices on the same physical GPU (time-sliced replicas, MIG instances on
one parent) score 60, the best PCIe level. MIG instances cannot use NVLink peer-to-peer, so two MIG
instances on different parents score their parents' PCIe closeness only, and the same parent is best.
A device kubelet names but we do not know scores 0 with everything. An allocation's score is the sum
over all pairs of its devices.

Objective. Devices are grouped into units (a whole GPU or a MIG instance, with its replicas); replicas
of one unit are interchangeable, so a choice is how many devices to take from each unit. Compared
lexicographically:
- `spread` (default): most distinct units, then the most even split (least sum of squared per-unit
  counts), then the best score. Without replicas every unit holds one device and only the score counts.
- `packed`: fewest distinct units, then the most devices on units that already hold a must_include
  device, then the most uneven split (largest sum of squares: units are filled up, so the ones with the
  most free replicas are taken first and the rest stay as free as possible), then the best score.
Among choices equal on all of that, the one that keeps the node usable: what it leaves free (the
remainder) is judged by the next requests. For each next-request size k, in the order 2, 4, 8, ... then
3, 5, 6, 7, ... (`next_sizes`), the best score of k distinct units that still have a free device (none
when fewer are left), compared in that order; then, with replicas, the free counts per unit: `spread`
wants them even (the next request can spread widest), `packed` uneven (free devices on as few units as
possible: whole GPUs stay whole; for packed the counts come before the sets). Why this measure: it is
the objective the next request will be served by (its best set by the same pair scores), so "best sets
left" means exactly what the plugin will be able to give; powers of two first because that is what
jobs ask for (parallel degrees), smaller first because they come more often, a larger size only
breaking the ties of the smaller (a sum over sizes would let the quadratically larger scores of big,
rare requests outvote the common small ones). Size 1 is not a criterion (any free unit serves it).
So on a DGX-1 with GPU 7 busy a 1-GPU request gets GPU 6, not 0: {0, 1, 2, 3} stays a fully linked quad
for a 4-GPU request, and 6 is, of 4, 5 and 6, the least linked to the rest. Remaining ties are broken
deterministically (the first set in unit order), so the same request gets the same answer.

Search. The first two parts of the objective fix how many units are used and, nearly, the split, so
the search enumerates only sets of units (and the few splits that tie on shape) and scores each: exact
whenever that costs at most `SEARCH_LIMIT` (every 8-GPU case, replicas included). The remainder then
decides among the tied sets: a table of every set's score over the units with free devices (2^units
entries, O(1) each), each size's sets ranked once, and per distinct remainder the first ranked set
inside it; exact up to ~10 such units, beyond that the sizes in order as long as their sets can be
scored within the limit (16 GPUs: pairs). Larger cases (dozens of MIG instances, say) use greedy
builds from a few promising first picks, each improved by single-device moves until none improves the
objective: the unit count and split come out optimal, the score close; the remainder plays no part.

Odd requests never raise (an error fails the pod's admission); the answer is always must_include first
(duplicates dropped, given order), then the chosen devices in `available` order:
- size <= len(must_include) (size 0 or negative included): must_include alone, even when longer than
  size: kubelet insists on it, and guessing which to drop would be worse.
- must_include IDs missing from `available` or unknown to the plugin: kept all the same; known ones
  still pull the rest of the choice towards their GPU.
- unknown IDs in `available`: usable, but only once the known devices are all taken (they score 0, and
  keeping them out of the search keeps every call O(n) in the IDs named, whatever a caller sends).
- duplicates anywhere: dropped.
- size larger than must_include + available: all of them, fewer than size (no IDs can be invented).
- an unknown placement: `spread`.
- anything unforeseen inside the search: must_include, then `available` order, up to size.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from gpunode.nvml.model import Inventory, TopologyLevel
from gpunode.plugin.devices import PluginDevice

log = logging.getLogger("gpunode.plugin.preferred")

SPREAD = "spread"
PACKED = "packed"

NVLINK_POINTS = 100
PCIE_POINTS: dict[TopologyLevel, int] = {
    TopologyLevel.INTERNAL: 60,
    TopologyLevel.SINGLE: 50,
    TopologyLevel.MULTIPLE: 40,
    TopologyLevel.HOSTBRIDGE: 30,
    TopologyLevel.NODE: 20,
    TopologyLevel.SYSTEM: 10,
}
SAME_DEVICE_POINTS = PCIE_POINTS[TopologyLevel.INTERNAL]

# Work allowed to the exhaustive search: candidates x units per candidate^2 (the pair scores summed to
# score them), a few ms of Python. 8 GPUs need at most C(8, 4) x 8^2 = 4480, replicas included, so only
# nodes with dozens of units (MIG instances) fall back to the heuristic.
SEARCH_LIMIT = 20_000
_SEEDS = 4  # first picks the heuristic builds from
_VERTEX_UNITS = 10  # exact uneven splits enumerate 2^n vertices; beyond this the greedy split is used


class Topology:
    """Pair scores between physical GPUs (by NVML index), computed once from the Inventory."""

    def __init__(self, full: Mapping[tuple[int, int], int], pcie: Mapping[tuple[int, int], int]) -> None:
        self._full = dict(full)
        self._pcie = dict(pcie)

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> Topology:
        full: dict[tuple[int, int], int] = {}
        pcie: dict[tuple[int, int], int] = {}
        for p in inventory.pairs:
            if p.a == p.b:
                continue
            closeness = PCIE_POINTS.get(p.level, 0) if p.level is not None else 0
            score = max(p.nvlinks, 0) * NVLINK_POINTS + closeness
            for key in ((p.a, p.b), (p.b, p.a)):
                full[key] = score
                pcie[key] = closeness
        return cls(full, pcie)

    def pair_score(self, a: int, b: int) -> int:
        """Higher is better; the same GPU scores as the best PCIe level, an unknown pair 0."""
        if a == b:
            return SAME_DEVICE_POINTS
        return self._full.get((a, b), 0)

    def pcie_score(self, a: int, b: int) -> int:
        """Like pair_score without NVLink: what counts between MIG instances."""
        if a == b:
            return SAME_DEVICE_POINTS
        return self._pcie.get((a, b), 0)

    def set_score(self, gpu_indexes: Iterable[int]) -> int:
        """Sum of pair_score over all pairs; a repeated index counts as a pair on the same GPU."""
        items = list(gpu_indexes)
        return sum(self.pair_score(a, b) for a, b in itertools.combinations(items, 2))


def preferred_allocation(  # noqa: PLR0917  (the gRPC server's interface: placement may be positional)
    topology: Topology,
    devices: Mapping[str, PluginDevice],
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    placement: str = SPREAD,
    *,
    search_limit: int = SEARCH_LIMIT,
) -> list[str]:
    """The IDs to offer kubelet: exactly `size` of them, with every must_include ID, best connected.

    See the module docstring for the objective and for what odd requests get. Never raises.
    """
    try:
        must = list(dict.fromkeys(must_include))
        if len(must) >= size:
            return must
        taken = set(must)
        rest = [i for i in dict.fromkeys(available) if i not in taken]
        need = size - len(must)
        if need >= len(rest):
            return must + rest
        # Unknown IDs never enter the search: each would be a unit of its own, and the pair scores are
        # quadratic in units (thousands of made-up IDs cost seconds and hundreds of MB). They score 0
        # with everything, so they are only ever the filler after the known devices; unknown
        # must_include IDs are in the answer anyway and change no comparison between choices.
        known = [i for i in rest if i in devices]
        if need >= len(known):
            filler = [i for i in rest if i not in devices][: need - len(known)]
            chosen = set(known).union(filler)
        else:
            chosen = _choose(
                topology,
                devices,
                [i for i in must if i in devices],
                known,
                need=need,
                spread=placement != PACKED,
                limit=search_limit,
            )
        return must + [i for i in rest if i in chosen]
    except Exception:  # an exception would fail the pod's admission; any valid answer is better
        log.exception("preferred allocation failed; answering must_include, then available in order")
        try:
            must = list(dict.fromkeys(must_include))
            return list(dict.fromkeys([*must, *available]))[: max(int(size), len(must))]
        except Exception:
            return []


# -- the problem, by unit ---------------------------------------------------------------------------


@dataclass
class _Unit:
    order: tuple[int, int, int]  # known units by GPU index and MIG slot, unknown IDs last, as given
    gpu: int | None  # physical GPU (parent of a MIG instance); None: an ID the plugin does not know
    mig: bool
    must: int = 0
    free: list[str] = field(default_factory=list)  # available IDs on the unit, in `available` order


Candidate = tuple[list[int], list[int]]  # units used (in unit order) and the device count on each


@dataclass
class _Problem:
    """Choose x[u] extra devices from each unit (0 <= x[u] <= a[u], sum == need), given m[u] forced ones."""

    s: list[list[int]]  # pair scores between units (diagonal: two devices on the same unit)
    m: list[int]
    a: list[int]
    need: int
    spread: bool
    limit: int

    @property
    def n(self) -> int:
        return len(self.m)

    def shape(self, members: Sequence[int], counts: Sequence[int]) -> tuple[int, ...]:
        """The parts of the objective before the score, which do not depend on the topology."""
        squares = sum(c * c for c in counts)
        if self.spread:
            return len(counts), -squares
        on_forced = sum(c for u, c in zip(members, counts, strict=True) if self.m[u] > 0)
        return -len(counts), on_forced, squares

    def score(self, members: Sequence[int], counts: Sequence[int]) -> int:
        total = 0
        for i, u in enumerate(members):
            row = self.s[u]
            cu = counts[i]
            total += cu * (cu - 1) // 2 * row[u]
            for j in range(i + 1, len(members)):
                total += cu * counts[j] * row[members[j]]
        return total

    def key(self, x: Sequence[int]) -> tuple[int, ...]:
        """The whole objective of extra counts x; larger is better."""
        members = [u for u in range(self.n) if self.m[u] + x[u] > 0]
        counts = [self.m[u] + x[u] for u in members]
        return (*self.shape(members, counts), self.score(members, counts))


def _choose(
    topology: Topology,
    devices: Mapping[str, PluginDevice],
    must: list[str],
    rest: list[str],
    *,
    need: int,
    spread: bool,
    limit: int,
) -> set[str]:
    units: dict[tuple[object, ...], _Unit] = {}

    def unit_of(device_id: str, position: int) -> _Unit:
        d = devices.get(device_id)
        if d is None:
            key: tuple[object, ...] = ("unknown", device_id)
            order = (1, position, 0)
            gpu, mig = None, False
        else:
            slot = d.mig.index if d.mig is not None else -1
            key = ("unit", d.gpu_index, slot)
            order = (0, d.gpu_index, slot)
            gpu, mig = d.gpu_index, d.mig is not None
        if key not in units:
            units[key] = _Unit(order, gpu, mig)
        return units[key]

    for pos, device_id in enumerate(must):
        unit_of(device_id, pos).must += 1
    for pos, device_id in enumerate(rest, start=len(must)):
        unit_of(device_id, pos).free.append(device_id)
    ordered = sorted(units.values(), key=lambda u: u.order)
    problem = _Problem(
        s=[[_unit_score(topology, u, v) for v in ordered] for u in ordered],
        m=[u.must for u in ordered],
        a=[len(u.free) for u in ordered],
        need=need,
        spread=spread,
        limit=max(limit, 0),
    )
    x = _solve(problem)
    return {device_id for u, take in zip(ordered, x, strict=True) for device_id in u.free[:take]}


def _unit_score(topology: Topology, u: _Unit, v: _Unit) -> int:
    if u.gpu is None or v.gpu is None:
        return 0
    if u.mig or v.mig:
        return topology.pcie_score(u.gpu, v.gpu)
    return topology.pair_score(u.gpu, v.gpu)


def _solve(p: _Problem) -> list[int]:
    tied = _spread_exact(p) if p.spread else _packed_exact(p)
    if tied is None:
        return _heuristic(p)
    return _most_usable(p, tied)


def _affordable(p: _Problem, candidates: int, members: int) -> bool:
    # Scoring one candidate sums members^2 / 2 pair scores; the limit bounds the total (and so the time).
    return candidates * max(members, 1) ** 2 <= p.limit


def _best(p: _Problem, candidates: Iterable[Candidate]) -> list[list[int]] | None:
    """Every candidate with the largest key, in the order found, as extra counts per unit; None if none.

    Candidates whose shape is already worse than the best are not scored. The number looked at is
    capped by the limit too, so an unexpectedly wide split enumeration still ends (with the best
    seen, a valid choice).
    """
    tied: list[Candidate] = []
    best_key: tuple[int, ...] | None = None
    for members, counts in itertools.islice(candidates, max(p.limit, 1)):
        shape = p.shape(members, counts)
        if best_key is not None and shape < best_key[: len(shape)]:
            continue
        key = (*shape, p.score(members, counts))
        if best_key is None or key > best_key:
            tied, best_key = [(members, counts)], key
        elif key == best_key:
            tied.append((members, counts))
    out = []
    for members, counts in tied:
        x = [0] * p.n
        for u, count in zip(members, counts, strict=True):
            x[u] = count - p.m[u]
        out.append(x)
    return out or None


# -- exact search -----------------------------------------------------------------------------------


def _spread_exact(p: _Problem) -> list[list[int]] | None:
    forced = [u for u in range(p.n) if p.m[u] > 0]
    fresh = [u for u in range(p.n) if p.m[u] == 0 and p.a[u] > 0]
    if p.need <= len(fresh):
        # Every extra device opens a unit of its own: only which units is left to choose.
        if not _affordable(p, math.comb(len(fresh), p.need), len(forced) + p.need):
            return None

        def opened(chosen: tuple[int, ...]) -> Candidate:
            members = sorted(forced + list(chosen))
            return members, [p.m[u] or 1 for u in members]

        return _best(p, (opened(k) for k in itertools.combinations(fresh, p.need)))
    # Every unit is used; the even split (water-filling) leaves only which units get one more.
    members = forced + fresh
    members.sort()
    lo = [max(p.m[u], 1) for u in members]
    hi = [p.m[u] + p.a[u] for u in members]
    total = sum(p.m) + p.need

    def filled(level: int) -> int:
        return sum(min(max(level, f), h) for f, h in zip(lo, hi, strict=True))

    level = 0
    while filled(level + 1) <= total:
        level += 1
    base = [min(max(level, f), h) for f, h in zip(lo, hi, strict=True)]
    ties = [i for i, (b, h) in enumerate(zip(base, hi, strict=True)) if b == level and h > level]
    extra = total - sum(base)
    if not _affordable(p, math.comb(len(ties), extra), len(members)):
        return None

    def topped(chosen: tuple[int, ...]) -> Candidate:
        counts = list(base)
        for i in chosen:
            counts[i] += 1
        return members, counts

    return _best(p, (topped(k) for k in itertools.combinations(ties, extra)))


def _packed_exact(p: _Problem) -> list[list[int]] | None:
    forced = [u for u in range(p.n) if p.m[u] > 0]
    fresh = [u for u in range(p.n) if p.m[u] == 0 and p.a[u] > 0]
    # Fewest units: fill the forced ones first, then open the roomiest; that count is the minimum.
    forced_room = sum(p.a[u] for u in forced)
    opened = 0
    left = p.need - forced_room
    for room in sorted((p.a[u] for u in fresh), reverse=True):
        if left <= 0:
            break
        left -= room
        opened += 1
    if not _affordable(p, math.comb(len(fresh), opened), len(forced) + opened):
        return None
    # Then as much as possible on the forced units: all but the one device each opened unit needs.
    onto_forced = min(p.need - opened, forced_room)
    onto_fresh = p.need - onto_forced
    forced_splits = list(
        _uneven_splits([p.m[u] for u in forced], [p.m[u] + p.a[u] for u in forced], sum(p.m) + onto_forced)
    )
    fresh_splits: dict[tuple[int, ...], list[list[int]]] = {}

    def candidates() -> Iterator[Candidate]:
        for chosen in itertools.combinations(fresh, opened):
            hi = tuple(p.a[u] for u in chosen)
            if sum(hi) < onto_fresh:
                continue
            # Sets of units with the same room (the usual case) share their splits.
            if hi not in fresh_splits:
                fresh_splits[hi] = list(_uneven_splits([1] * opened, list(hi), onto_fresh))
            members = forced + list(chosen)
            for head in forced_splits:
                for tail in fresh_splits[hi]:
                    yield members, head + tail

    return _best(p, candidates())


def _uneven_splits(lo: list[int], hi: list[int], total: int) -> Iterator[list[int]]:
    """Every split lo <= c <= hi, sum total, with the largest sum of squares (there may be several)."""
    n = len(lo)
    if len(set(lo)) <= 1:
        # Equal floors: filling the roomiest first gives counts that majorize every other split, so the
        # optimal splits are exactly the placements of those counts that fit under each ceiling.
        left = total - sum(lo)
        counts = []
        for space in sorted((h - f for h, f in zip(hi, lo, strict=True)), reverse=True):
            take = min(space, left)
            left -= take
            counts.append((lo[0] if lo else 0) + take)
        yield from _placements(sorted(counts, reverse=True), hi)
        return
    if n > _VERTEX_UNITS:
        yield _greedy_split(lo, hi, total)
        return
    # Uneven floors (several forced replicas on one unit): a convex maximum lies on a vertex, i.e. every
    # unit at its floor or ceiling but at most one, so enumerate those and keep the largest.
    room = [h - f for h, f in zip(hi, lo, strict=True)]
    left = total - sum(lo)
    found: list[list[int]] = []
    best = -1
    for mask in range(1 << n):
        full = [(mask >> u) & 1 == 1 for u in range(n)]
        r = left - sum(room[u] for u in range(n) if full[u])
        if r < 0:
            continue
        base = [hi[u] if full[u] else lo[u] for u in range(n)]
        options = [base] if r == 0 else []
        for u in range(n):
            if r > 0 and not full[u] and room[u] > r:
                c = list(base)
                c[u] += r
                options.append(c)
        for c in options:
            squares = sum(v * v for v in c)
            if squares > best:
                best, found = squares, [c]
            elif squares == best:
                found.append(c)
    yield from found


def _placements(counts: list[int], hi: list[int]) -> Iterator[list[int]]:
    """Distinct ways to give each unit one of `counts` (a multiset, descending) without passing hi."""
    n = len(hi)
    out = [0] * n
    remaining = dict.fromkeys(counts, 0)
    for v in counts:
        remaining[v] += 1

    def place(u: int) -> Iterator[list[int]]:
        if u == n:
            yield list(out)
            return
        for v in remaining:
            if remaining[v] and v <= hi[u]:
                remaining[v] -= 1
                out[u] = v
                yield from place(u + 1)
                remaining[v] += 1

    yield from place(0)


def _greedy_split(lo: list[int], hi: list[int], total: int) -> list[int]:
    c = list(lo)
    left = total - sum(lo)
    for u in sorted(range(len(lo)), key=lambda u: -hi[u]):
        take = min(hi[u] - c[u], left)
        c[u] += take
        left -= take
    return c


# -- what the choice leaves free ---------------------------------------------------------------------


def next_sizes(units: int) -> list[int]:
    """The request sizes a remainder is judged by, most decisive first: 2, 4, 8, ... then 3, 5, 6, 7, ...

    Jobs ask for powers of two (data- and tensor-parallel degrees), and smaller requests come more
    often, so those decide first and a larger size only breaks their ties. Size 1 is left out: any
    non-empty remainder serves it equally.
    """
    powers = [1 << b for b in range(1, max(units, 1).bit_length()) if 1 << b <= units]
    return powers + [k for k in range(3, units + 1) if k not in powers]


def _most_usable(p: _Problem, tied: list[list[int]]) -> list[int]:
    """Of candidates equal on the objective, the one whose remainder keeps the best sets (the first one
    of those, in the order found).

    A remainder (each unit's free devices less the ones taken) is judged by the sets of units it leaves:
    for each size k of `next_sizes(units that had a free device)`, the best set score of k distinct units
    that still have a free device (-1 when fewer than k are left), compared in that order; and by its
    free counts: `spread` keeps them even (least sum of squares, the next request can spread as far
    as possible), `packed` keeps them uneven (largest: the devices left are on as few units as possible,
    whole GPUs stay whole). Spread compares the sets first, then the counts; packed the counts first.
    With whole GPUs the counts are the same for every candidate and only the sets count.

    The sets cost 2^units (a table of every set's score) plus at most 2^free units per distinct
    remainder (the sets looked at before the first one inside it). When that is over the limit (more
    than ~10 units with free devices), the sizes are taken in order, each by enumerating its sets, as
    long as the work fits the limit (on 16 GPUs: size 2, pairs).
    """
    if len(tied) == 1:
        return tied[0]
    free = [u for u in range(p.n) if p.a[u] > 0]
    remainders: list[int] = []  # bit i: free[i] still has a free device
    squares: list[int] = []  # of the free counts per unit
    for x in tied:
        mask = total = 0
        for i, u in enumerate(free):
            left = p.a[u] - x[u]
            if left:
                mask |= 1 << i
                total += left * left
        remainders.append(mask)
        squares.append(total)
    distinct = set(remainders)
    sizes = next_sizes(len(free))
    sets: dict[int, tuple[int, ...]] = dict.fromkeys(distinct, ())
    if len(distinct) > 1:
        if (1 << len(free)) * 2 + sum(1 << m.bit_count() for m in distinct) <= p.limit:
            table = _set_scores(p, free)
            ranked = _ranked_sets(table, len(free), sizes)
            sets = {m: _best_by_size(table, ranked, m) for m in distinct}
        else:
            sets = _best_by_size_within(p, free, distinct, sizes)

    def key(i: int) -> tuple[tuple[int, ...], ...]:
        sets_left = sets[remainders[i]]
        return (sets_left, (-squares[i],)) if p.spread else ((squares[i],), sets_left)

    return tied[max(range(len(tied)), key=key)]  # max() keeps the first of equals


def _set_scores(p: _Problem, free: list[int]) -> list[int]:
    """The score of every set of the units in `free`, indexed by bitmask (bit i: free[i])."""
    table = [0]
    for i, u in enumerate(free):
        # The sets holding unit i are the sets of the units before it plus i: their score plus i's pairs
        # with them. Built by doubling in list comprehensions, ~30x faster than a loop per set.
        row = p.s[u]
        cross = [0]
        for j in range(i):
            w = row[free[j]]
            cross += [c + w for c in cross]
        table += [t + c for t, c in zip(table, cross, strict=True)]
    return table


def _best_by_size_within(
    p: _Problem, free: list[int], masks: set[int], sizes: list[int]
) -> dict[int, tuple[int, ...]]:
    """Like _best_by_size for each mask, for the sizes (in order) whose sets can all be scored within the
    limit; the same sizes for every mask, so the tuples compare like the exact ones, shortened."""
    units = {m: [free[i] for i in range(len(free)) if m >> i & 1] for m in masks}
    out: dict[int, list[int]] = {m: [] for m in masks}
    spent = 0
    for k in sizes:
        spent += sum(math.comb(len(us), k) for us in units.values()) * k * (k - 1) // 2
        if spent > p.limit:
            break
        for m, us in units.items():
            best = -1
            for c in itertools.combinations(us, k):
                best = max(best, sum(p.s[u][v] for u, v in itertools.combinations(c, 2)))
            out[m].append(best)
    return {m: tuple(v) for m, v in out.items()}


@functools.cache
def _masks_by_count(units: int) -> tuple[tuple[int, ...], ...]:
    """Every bitmask of `units` bits, grouped by how many bits are set, ascending (fixed per size)."""
    groups: list[list[int]] = [[] for _ in range(units + 1)]
    for mask in range(1 << units):
        groups[mask.bit_count()].append(mask)
    return tuple(map(tuple, groups))


def _ranked_sets(table: list[int], units: int, sizes: list[int]) -> list[list[int]]:
    """For each of the sizes, every set of that many units as a bitmask, best score first (then the
    lowest mask: sorted() is stable)."""
    groups = _masks_by_count(units)
    return [sorted(groups[k], key=table.__getitem__, reverse=True) for k in sizes]


def _best_by_size(table: list[int], ranked: list[list[int]], mask: int) -> tuple[int, ...]:
    """For each size, the best score of a set of that many units within `mask`; -1 if mask is smaller.

    The first ranked set inside the mask: a remainder lacks only the few units just taken, so it is
    usually among the first few (at worst every set of the size is looked at once)."""
    outside = ~mask
    out = []
    for sets in ranked:
        for m in sets:
            if not m & outside:
                out.append(table[m])
                break
        else:
            out.append(-1)
    return tuple(out)


# -- heuristic --------------------------------------------------------------------------------------


def _heuristic(p: _Problem) -> list[int]:
    """Greedy builds from the few most promising first picks, each improved by single-device moves."""
    n = p.n
    c = list(p.m)
    gain = _affinity(p, c)
    # The first pick decides most of a greedy build, and the best-looking one is often a trap (the
    # partner of a forced GPU across the socket, say): try several, ranked like the greedy's own
    # steps, then by how much the unit could be joined by the devices still free.
    reach = [sum(map(operator.mul, row, p.a)) - row[u] * p.a[u] for u, row in enumerate(p.s)]
    ranked = sorted(
        (u for u in range(n) if p.a[u] > 0),
        key=lambda u: (*_step(p, c, [0] * n, gain, u), reach[u]),
        reverse=True,
    )
    best: list[int] | None = None
    best_key: tuple[int, ...] | None = None
    for seed in ranked[:_SEEDS]:
        x = _improve(p, _greedy(p, seed))
        k = p.key(x)
        if best_key is None or k > best_key:
            best, best_key = x, k
    return best if best is not None else [0] * n


def _affinity(p: _Problem, c: list[int]) -> list[int]:
    """What one more device on each unit adds to the score, given counts c."""
    return [sum(map(operator.mul, row, c)) for row in p.s]


def _step(p: _Problem, c: list[int], x: list[int], gain: list[int], u: int) -> tuple[int, ...]:
    """How good one more device on unit u looks to the greedy build; larger is better."""
    if p.spread:
        # A new unit first, then the least used one, then the best connected.
        return int(c[u] == 0), -c[u], gain[u]
    # Units already in use first, forced ones before the rest, the fullest first; then a new unit with
    # the most room (fewest units), then the best connected.
    return int(c[u] > 0), int(p.m[u] > 0), c[u], p.a[u] - x[u], gain[u]


def _greedy(p: _Problem, seed: int) -> list[int]:
    n = p.n
    c = list(p.m)
    x = [0] * n
    gain = _affinity(p, c)
    u = seed
    for _ in range(p.need):
        c[u] += 1
        x[u] += 1
        row = p.s[u]
        for v in range(n):
            gain[v] += row[v]
        open_units = [v for v in range(n) if x[v] < p.a[v]]
        if not open_units:
            break
        u = max(open_units, key=lambda v: _step(p, c, x, gain, v))
    return x


def _improve(p: _Problem, x: list[int]) -> list[int]:
    n = p.n
    x = list(x)
    c = [p.m[u] + x[u] for u in range(n)]
    gain = _affinity(p, c)
    unchanged = (0,) * (3 if p.spread else 4)
    for _ in range(4 * p.need + n):
        best = unchanged  # only strict improvements: the walk must end
        move: tuple[int, int] | None = None
        for g in range(n):
            if x[g] == 0:
                continue
            loss = gain[g] - p.s[g][g]
            for h in range(n):
                if h == g or x[h] >= p.a[h]:
                    continue
                d_distinct = int(c[h] == 0) - int(c[g] == 1)
                d_squares = 2 * (c[h] - c[g]) + 2
                d_score = gain[h] - p.s[h][g] - loss
                if p.spread:
                    delta: tuple[int, ...] = (d_distinct, -d_squares, d_score)
                else:
                    d_forced = int(p.m[h] > 0) - int(p.m[g] > 0)
                    delta = (-d_distinct, d_forced, d_squares, d_score)
                if delta > best:
                    best, move = delta, (g, h)
        if move is None:
            break
        g, h = move
        x[g] -= 1
        c[g] -= 1
        x[h] += 1
        c[h] += 1
        for v in range(n):
            gain[v] += p.s[v][h] - p.s[v][g]
    return x
