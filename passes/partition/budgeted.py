"""The split under memory budgets, and what the least memory any split needs when none fits.

The searches of :mod:`fxpipe.passes.partition.search` take each stage position's memory limit
inside them (:class:`fxpipe.passes.partition.fit.StageFit`): a stage over its limit is never a
candidate of the exact search on ideals, of the exact split of an order, of the windows or
of refinement. How the devices' budgets become limits:

1. The split found without limits is kept when every device holds its stages: it is then
   also the best split under the budgets.
2. Each stage is limited to its device's whole budget. When no two stages share a device
   this is exactly the constraint, so the search is as exact under budgets as without
   (exact over every convex split on the ideals; on larger graphs exact per order and
   within windows). With a shared device it is a relaxation: when the split it finds fits
   every device's total, that split is the best under the budgets too.
3. A device that holds several stages bounds their *sum*, which adds up over stages like
   the bytes a split sends: for a cap on the bottleneck, the split of least summed memory
   on that device is an exact search, and that sum only falls as the cap grows. So a
   bisection on the cap finds the smallest bottleneck whose least sum fits: exact (to a
   relative 1e-9) on the ideals when one device is shared, whatever the other devices.
   With several shared devices each is taken so in turn while the others' budgets are
   divided equally among their stages; when that finds nothing, divisions of every shared
   budget (equal, in proportion to the least-memory split, and near splits that overflow
   by a stage giving up the overflow) are searched. Every division adds up to its
   budget, so what is found fits, but a better split may need a division not tried:
   with several shared devices the search is sound, not exact.

On graphs too large for the exact search, the searches under limits run on candidate
orders and windows, as without limits: they may miss a split that fits. The split that
needs the least memory (found likewise) is then tried too, its borders moved within
windows for a smaller bottleneck, so a plan is refused only when no split tried fits.
``slack`` applies to the splits of steps 1 and 2; the others keep the smallest
bottleneck found.

When no split fits, :class:`fxpipe.errors.MemoryPlanError` reports the split that needs the
least memory, found by the same searches with memory as the objective (the largest ratio
of a stage's memory to its limit, shared budgets divided equally), device by device, and
which remedies make it fit: ``checkpoint="always"``, more ``chunks``, more devices of the
smallest budget, a smaller batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import networkx as nx
import numpy as np

from fxpipe.errors import MemoryPlanError
from fxpipe.passes.partition.fit import StageFit
from fxpipe.passes.partition.memory import ESTIMATE, Entering, MemoryModel
from fxpipe.passes.partition.memory_tables import UnitMemory, unit_memory
from fxpipe.passes.partition.units import Units

__all__ = ["Found", "Search", "fit_budgets"]

#: A split as the partitioner reports it: (unit stages, method, bytes sent, bottleneck).
Found = tuple[np.ndarray, str, float, float]

_GIB = 2**30
#: Most divisions of shared budgets searched before giving up (each is a whole search).
MAX_DIVISIONS = 12
#: Most halvings of the bottleneck interval when one device holds several stages.
BISECTIONS = 40


class Search(Protocol):
    """The partitioner's searches of one graph
    (:class:`fxpipe.passes.partition.search._Search`)."""

    @property
    def k(self) -> int: ...

    @property
    def units(self) -> Units: ...

    @property
    def g(self) -> nx.DiGraph: ...

    def split(self, fit: StageFit) -> Found | None: ...

    def least_memory(self, fit: StageFit, *, quick: bool = False) -> np.ndarray | None: ...

    def found(self, unit_stage: np.ndarray, method: str, fit: StageFit) -> Found: ...

    def improve(self, unit_stage: np.ndarray, fit: StageFit) -> Found: ...

    def least_sum(
        self, fit: StageFit, weights: np.ndarray, cap: float
    ) -> tuple[float, np.ndarray] | None: ...

    @property
    def exact(self) -> bool: ...

    def entering(self) -> list[Entering]: ...

    def with_stages(self, k: int) -> Search | None: ...


def fit_budgets(
    search: Search, found: Found, fit: StageFit, model: MemoryModel
) -> tuple[Found, str]:
    """The best split whose devices each hold their stages (``found``: the best without
    limits), and how it was found; MemoryPlanError when none fits."""
    units = search.units
    priced = unit_memory(model, search.g, units.unit_of, units.num_units, search.entering())
    budgets = _budgets(model)
    groups = model.device_groups()
    if _fits_devices(priced, found[0], groups, budgets):
        return found, "the best split fits every device"
    whole = search.split(StageFit(fit.speeds, priced, budgets))
    if whole is not None and _fits_devices(priced, whole[0], groups, budgets):
        return whole, "searched with each stage's memory limit"
    shared = [js for js in groups.values() if len(js) > 1]
    if whole is None and search.exact:
        raise _no_fit_error(search, priced, model, budgets)  # not even one stage per device
    equal = _equal_shares(groups, budgets)
    least = search.least_memory(StageFit(None, priced, equal))
    candidates: list[Found] = []
    if least is not None and _fits_devices(priced, least, groups, budgets):
        limits = _shares_like(priced.stage_bytes(least), groups, budgets)
        candidates.append(search.improve(least, StageFit(fit.speeds, priced, limits)))
    for js in shared:  # one shared device exactly, the others (if any) by equal shares
        limits = equal.copy()
        limits[js] = budgets[js[0]]
        low = whole[3] if whole is not None else found[3]  # no split does better
        one = _one_device_exact(search, fit, priced, limits, js, budgets[js[0]], low)
        if one is not None and _fits_devices(priced, one[0], groups, budgets):
            candidates.append(one)
    if len(shared) == 1 and search.exact:  # that search was exact over every split
        if not candidates:
            raise _no_fit_error(search, priced, model, budgets, least)
        best = min(candidates, key=lambda c: (c[3], c[2]))
        return best, "searched exactly with the shared budget on the stages' sum"
    if candidates:  # divisions of shared budgets only when nothing else fits
        shared = []
    divisions = [equal] if shared else []
    if shared and least is not None:
        divisions.append(_shares_like(priced.stage_bytes(least), groups, budgets))
    if shared:
        overflowing = [found[0]] + ([whole[0]] if whole is not None else [])
        for unit_stage in overflowing:
            divisions.extend(_shrunk(priced.stage_bytes(unit_stage), groups, budgets))
    tried = 0
    while divisions and tried < MAX_DIVISIONS:
        limits = divisions.pop(0)
        tried += 1
        found_here = search.split(StageFit(fit.speeds, priced, limits))
        if found_here is None:
            continue
        if _fits_devices(priced, found_here[0], groups, budgets):
            candidates.append(found_here)
        elif not candidates:  # look near it: shrink a stage of each device it overflows
            divisions.extend(_shrunk(priced.stage_bytes(found_here[0]), groups, budgets))
    if not candidates:
        raise _no_fit_error(search, priced, model, budgets, least)
    best = min(candidates, key=lambda c: (c[3], c[2]))
    return best, "searched with each shared budget on its stages' sum, or divided among them"


def _gib(size: float) -> str:
    """Bytes in GiB: three decimals, or four significant digits below 1 GiB (enough to set
    a budget from)."""
    gib = float(size) / _GIB
    return f"{gib:.3f}" if gib >= 1 else f"{gib:.4g}"


def _one_device_exact(
    search: Search,
    fit: StageFit,
    priced: UnitMemory,
    limits: np.ndarray,
    stages: list[int],
    budget: float,
    low: float,
) -> Found | None:
    """The smallest bottleneck of the splits whose ``stages`` (one device's) hold at most
    ``budget`` together and whose every stage is within ``limits``: a bisection on the
    bottleneck from ``low`` (no split is faster), each step asking for the split of least
    summed memory on the device under that cap (the sum only falls as the cap grows).
    Exact, up to a relative 1e-9, where the search is exact (on the ideals); on orders it
    stops at a relative 1e-4."""
    weights = np.zeros(len(limits))
    weights[stages] = 1.0
    bounded = StageFit(fit.speeds, priced, limits)
    first = search.least_sum(bounded, weights, math.inf)
    if first is None or first[0] > budget:
        return None
    best = first[1]
    high = float(bounded.times(search.units.weight, best, search.k).max())
    precision = 1e-9 if search.exact else 1e-4
    for _ in range(BISECTIONS):
        if high - low <= precision * max(high, 1e-300):
            break
        cap = (low + high) / 2
        found = search.least_sum(bounded, weights, cap)
        if found is not None and found[0] <= budget:
            best = found[1]
            high = float(bounded.times(search.units.weight, best, search.k).max())
        else:
            low = cap
    return search.found(best, "least time within the shared budget", fit)


def _budgets(model: MemoryModel) -> np.ndarray:
    return np.array([math.inf if b is None else float(b) for b in model.budgets])


Groups = dict[str, list[int]]


def _fits_devices(
    priced: UnitMemory, unit_stage: np.ndarray, groups: Groups, budgets: np.ndarray
) -> bool:
    """Whether every device holds the stages of ``unit_stage`` it runs."""
    need = priced.stage_bytes(unit_stage)
    return all(need[js].sum() <= budgets[js[0]] for js in groups.values())


def _equal_shares(groups: Groups, budgets: np.ndarray) -> np.ndarray:
    """Each stage's limit when its device's budget is divided equally among its stages."""
    limits = budgets.copy()
    for js in groups.values():
        limits[js] = budgets[js[0]] / len(js)
    return limits


def _shrunk(per_stage: np.ndarray, groups: Groups, budgets: np.ndarray) -> list[np.ndarray]:
    """Divisions near a split that overflows a shared device: each stage there in turn
    gives up the overflow, the others keep what they hold (the limits add up to the
    budget); devices that hold their stages keep their budgets."""
    out = []
    for js in groups.values():
        over = float(per_stage[js].sum() - budgets[js[0]])
        if len(js) < 2 or not over > 0:
            continue
        for j in js:
            if per_stage[j] > over:
                limits = budgets.copy()
                limits[js] = per_stage[js]
                limits[j] -= over
                out.append(limits)
    return out


def _shares_like(per_stage: np.ndarray, groups: Groups, budgets: np.ndarray) -> np.ndarray:
    """Each device's budget divided among its stages in proportion to ``per_stage``."""
    limits = budgets.copy()
    for js in groups.values():
        total = float(per_stage[js].sum())
        if len(js) > 1 and total > 0:
            limits[js] = budgets[js[0]] * per_stage[js] / total
    return limits


# ------------------------------------------------------------------------- no split fits


def _no_fit_error(
    search: Search,
    priced: UnitMemory,
    model: MemoryModel,
    budgets: np.ndarray,
    least: np.ndarray | None = None,
) -> MemoryPlanError:
    """The error naming, device by device, what the least-memory split needs (``least``,
    when the caller has searched for it with equal shares already), and the remedies that
    make it fit."""
    groups = model.device_groups()
    if least is None:
        least = search.least_memory(StageFit(None, priced, _equal_shares(groups, budgets)))
    which = "no split" if search.exact else "no split found (orders and windows tried)"
    header = (
        f"{which} of the model into {search.k} stages fits the devices' memory with "
        f"chunks={model.chunks}, checkpoint={model.checkpoint!r} ({ESTIMATE[model.training]})"
    )
    if least is None:  # pragma: no cover - a split always exists when the graph has cuts
        return MemoryPlanError(f"{header}; add devices or use devices with more memory")
    need = priced.stage_bytes(least)
    rows = []
    for device, js in groups.items():
        budget = budgets[js[0]]
        have = f"{_gib(budget)} GiB" if np.isfinite(budget) else "no budget"
        rows.append(f"  {device}: needs ~{_gib(need[js].sum())} GiB for stages {js} of {have}")
    remedies = _remedies(search, priced, model, budgets, least)
    shared = [d for d, js in groups.items() if len(js) > 1]
    note = (
        f" (stages sharing {', '.join(shared)} were searched with equal and proportional "
        "shares of its budget, a sound but not exhaustive search)"
        if shared
        else ""
    )
    return MemoryPlanError(
        f"{header}{note}. The split {'' if search.exact else 'found '}that needs the least "
        "memory needs:\n" + "\n".join(rows) + f"\nremedy: {remedies}"
    )


def _least_fits(search: Search, priced: UnitMemory, groups: Groups, budgets: np.ndarray) -> bool:
    """Whether the least-memory split under ``priced`` fits every device (on large graphs
    the structured orders only: this answers what-ifs)."""
    limits = _equal_shares(groups, budgets)
    least = search.least_memory(StageFit(None, priced, limits), quick=True)
    return least is not None and _fits_devices(priced, least, groups, budgets)


def _remedies(
    search: Search,
    priced: UnitMemory,
    model: MemoryModel,
    budgets: np.ndarray,
    least: np.ndarray,
) -> str:
    """Each change that alone makes a split fit, or what is left when none does."""
    groups = model.device_groups()
    found: list[str] = []
    if model.training and model.checkpoint != "always":
        always = dataclasses.replace(priced, checkpoint="always")
        if _least_fits(search, always, groups, budgets):
            found.append("checkpoint='always' (each stage then keeps only its inputs)")
    for chunks in (2 * model.chunks, 4 * model.chunks, 8 * model.chunks):
        if chunks > model.batch:
            break
        more = dataclasses.replace(priced, chunks=chunks)
        if _least_fits(search, more, groups, budgets):
            found.append(f"chunks={chunks} (smaller micro-batches in flight)")
            break
    found.extend(_more_devices(search, priced, budgets))
    params, activations = priced.parts(least)
    found.extend(_smaller_batch(model, budgets, params, activations))
    if found:
        return "any one of: " + "; ".join(found)
    return (
        "none of checkpoint='always', more chunks, a smaller batch or up to twice the "
        "devices gets there alone; use devices with more memory, or combine these"
    )


def _more_devices(search: Search, priced: UnitMemory, budgets: np.ndarray) -> list[str]:
    """The fewest devices (up to twice as many) of the smallest budget that hold a split."""
    finite = budgets[np.isfinite(budgets)]
    if not len(finite):
        return []
    smallest = float(finite.min())
    for k in range(search.k + 1, 2 * search.k + 1):
        wider = search.with_stages(k)
        if wider is None:
            break
        spread = dataclasses.replace(priced, k=k)
        groups = {f"device {j}": [j] for j in range(k)}
        if _least_fits(wider, spread, groups, np.full(k, smallest)):
            return [f"{k} devices of {_gib(smallest)} GiB each (pass more devices)"]
    return []


def _smaller_batch(
    model: MemoryModel, budgets: np.ndarray, params: np.ndarray, activations: np.ndarray
) -> list[str]:
    """The largest batch at which the least-memory split fits (activations scale with it)."""
    scale = math.inf
    for js in model.device_groups().values():
        budget = budgets[js[0]]
        fixed, scaled = float(params[js].sum()), float(activations[js].sum())
        if not np.isfinite(budget):
            continue
        if fixed >= budget:
            return []
        if scaled > 0:
            scale = min(scale, (budget - fixed) / scaled)
    samples = int(scale * model.batch) if np.isfinite(scale) else 0
    if 1 <= samples < model.batch:
        return [f"a batch of at most {samples} samples (the example has {model.batch})"]
    return []
