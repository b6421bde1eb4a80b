"""The default cost: a node's forward + backward seconds from its FLOPs and bytes (a roofline).

A node does arithmetic on one kind of unit (matrix products, convolutions, attention,
element-wise math) and moves bytes: the activations it reads and writes, the weights it
reads on every micro-batch, the weight gradients it writes. On a device of kind ``d``, for
a batch cut into ``M`` micro-batches, it takes

    M * kernels * overhead + combine(sum(flops[unit] / rate[unit]), bytes / bandwidth)
        + gradient additions into ``.grad`` / bandwidth

where ``combine`` is the larger of the two (the classic roofline, on GPUs) or their sum
(one CPU core seldom overlaps them), and the bandwidth is the caches' for what fits in them
(a few MiB of activations per micro-batch, weights read again and again) and memory's
beyond. Convolutions over small maps (a few positions per image) run below their rate.
A weight read by several nodes (a tied embedding) has its gradients added where it lives.

Nothing is measured while planning: the constants (:data:`ROOFLINES`) are the same on every
machine and under every load, so the same model, example, devices and micro-batch count
give the same costs, bit for bit, on every run and every rank. The CPU constants come from
single-op measurements on one core of a shared x86 server (``python -m benchmarks.planning
--calibrate``), checked against stage times ``fxpipe.record`` measures on whole models; the
CUDA ones are nominal figures for a current data-centre GPU (float32 products, TF32
convolutions, 16-bit floats ``low_precision`` times faster). Only the ratios between nodes
decide a split; the seconds say what the reference device would take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

__all__ = [
    "Roofline",
    "Work",
    "Operand",
    "ROOFLINES",
    "UNITS",
    "HEAVY_ELEMENTWISE",
    "MEMORY_PASSES",
    "GATHER_OPS",
    "roofline_for",
    "STEP_ROOFLINES",
    "step_roofline_for",
    "node_work",
    "attribute_work",
]

#: The kinds of arithmetic unit a roofline tells apart.
UNITS = ("matmul", "conv", "attention", "vector")

#: Forward FLOP per output element of element-wise ops heavier than one FLOP.
HEAVY_ELEMENTWISE = {
    "layer_norm": 8,
    "batch_norm": 8,
    "group_norm": 8,
    "instance_norm": 8,
    "rms_norm": 6,
    "native_layer_norm": 8,
    "native_batch_norm": 8,
    "_native_batch_norm_legit": 8,
    "_native_batch_norm_legit_functional": 8,
    "_native_batch_norm_legit_no_training": 8,
    "softmax": 5,
    "log_softmax": 5,
    "_softmax": 5,
    "_log_softmax": 5,
    "gelu": 8,
    "silu": 4,
    "tanh": 4,
    "sigmoid": 4,
    "exp": 4,
    "erf": 8,
    "cross_entropy": 6,
    "dropout": 2,
    "native_dropout": 2,
}

#: Passes over memory of ops that read their input several times (statistics first).
MEMORY_PASSES = {
    "batch_norm": 2,
    "native_batch_norm": 2,
    "_native_batch_norm_legit": 2,
    "_native_batch_norm_legit_functional": 2,
    "_native_batch_norm_legit_no_training": 2,
    "layer_norm": 3,
    "native_layer_norm": 3,
    "group_norm": 3,
    "native_group_norm": 3,
    "instance_norm": 3,
    "rms_norm": 3,
    "softmax": 2,
    "_softmax": 2,
    "log_softmax": 2,
    "_log_softmax": 2,
    "cross_entropy": 2,
}

#: Ops that read a few rows of a large table (its gradient is still the whole table).
GATHER_OPS = frozenset({"embedding", "embedding_bag", "index_select", "gather", "take"})

#: Fixed cost of a view (metadata only) relative to a kernel's.
VIEW_KERNELS = 0.25


@dataclass(frozen=True)
class Work:
    """What one node does for the whole example batch, forward and backward together."""

    #: FLOP per kind of unit (keys from :data:`UNITS`), proportional to the batch.
    flops: Mapping[str, float] = field(default_factory=dict)
    #: Bytes of activations read and written, proportional to the batch.
    bytes: float = 0.0
    #: Bytes read on every micro-batch whatever its size (weights, buffers) and the
    #: parameter gradients each one writes.
    fixed_bytes: float = 0.0
    #: Bytes of the weights and buffers it reads: they stay in the caches from one
    #: micro-batch to the next when they fit.
    weight_bytes: float = 0.0
    #: Bytes of the parameters whose ``.grad`` the node adds gradients into.
    grad_bytes: float = 0.0
    #: Gradients added per micro-batch (several for a tied weight read by several nodes).
    grads: int = 1
    #: Output positions per image of its convolutions (small maps use the units poorly).
    pixels: float = 0.0
    #: Kernels launched per micro-batch (forward and backward).
    kernels: float = 0.0
    #: Whether the arithmetic is in 16-bit floats (faster units on some devices).
    low_precision: bool = False
    #: False when the node reads no model input, directly or not: its work does not
    #: shrink with the micro-batch and is done in full on every one.
    batched: bool = True


@dataclass(frozen=True)
class Operand:
    """One tensor a node reads: an activation, or a weight or buffer (``fixed``)."""

    bytes: int
    #: Whether it requires grad (backward computes a gradient for it).
    grad: bool
    #: A parameter or buffer: its size does not depend on the batch.
    fixed: bool
    #: Whether it has two dimensions or more (a matrix operand of a product).
    matrix: bool
    #: Whether its gradient is added to ``.grad`` here (a module's own parameter), not
    #: where the value comes from (a ``get_attr``, which may feed several nodes).
    owned: bool = False


@dataclass(frozen=True)
class Roofline:
    """Sustained rates of one kind of device: FLOP/s per unit, bytes/s, seconds per kernel."""

    #: What the seconds refer to, for the plan's summary.
    reference: str
    matmul: float
    conv: float
    attention: float
    vector: float
    #: Memory bandwidth, bytes/s, for data that does not fit in the caches.
    bandwidth: float
    #: Fixed cost of one kernel (Python, dispatch and autograd bookkeeping included).
    overhead: float
    #: Output positions per image at which a convolution runs at half its rate.
    conv_pixels: float = 0.0
    #: Speed-up of matrix products, convolutions and attention in 16-bit floats.
    low_precision: float = 1.0
    #: Memory traffic of adding a gradient to ``.grad``, in bytes per byte of parameter
    #: (read both, write one); the first gradient of a step is kept as it is.
    accumulate: float = 3.0
    #: How far arithmetic and memory traffic overlap: 1 takes the larger of the two
    #: times (the classic roofline), 0 their sum.
    overlap: float = 1.0
    #: Bandwidth of the caches (0: no cache term), and the bytes at which half of the
    #: traffic is served at that rate: of the activations a node moves per micro-batch
    #: (written fresh each time), and of the weights it reads (the same every time).
    cache_bandwidth: float = 0.0
    cache_bytes: float = 0.0
    resident_bytes: float = 0.0
    #: Whether a micro-batch's activations are served from the caches at its own size
    #: (smaller micro-batches faster per byte), or at the whole batch's, as whole steps of
    #: many micro-batches measure on the CPU (:data:`STEP_ROOFLINES`).
    micro_batch_caches: bool = True

    def seconds(self, work: Work, micro_batches: int = 1) -> float:
        """Forward + backward seconds of ``work`` for the batch in ``micro_batches`` pieces."""
        m = max(int(micro_batches), 1)
        repeat = 1 if work.batched else m
        moved = work.bytes * repeat
        resident = self.bandwidth_for(work.weight_bytes, self.resident_bytes)
        piece = moved / m if self.micro_batch_caches else moved
        memory = moved / self.bandwidth_for(piece) + work.fixed_bytes * m / resident
        compute = self._compute(work) * repeat
        busy = max(compute, memory) + (1.0 - self.overlap) * min(compute, memory)
        added = work.grad_bytes * self.accumulate * max(work.grads * m - 1, 0)
        return m * work.kernels * self.overhead + busy + added / resident

    def bandwidth_for(self, nbytes: float, cache_bytes: float | None = None) -> float:
        """Bandwidth for moving ``nbytes`` at a time: the caches' for small amounts,
        memory's for large ones (``cache_bytes``: where half is served from the caches)."""
        size = self.cache_bytes if cache_bytes is None else cache_bytes
        if size <= 0 or self.cache_bandwidth <= 0:
            return self.bandwidth
        cached = size / (size + nbytes)
        return self.bandwidth + (self.cache_bandwidth - self.bandwidth) * cached

    def _compute(self, work: Work) -> float:
        speedup = self.low_precision if work.low_precision else 1.0
        seconds = 0.0
        for unit, flops in work.flops.items():
            if unit == "vector":
                seconds += flops / self.vector
                continue
            rate = getattr(self, unit) * speedup
            if unit == "conv" and work.pixels > 0:
                rate *= work.pixels / (work.pixels + self.conv_pixels)
            seconds += flops / rate
        return seconds


#: The constants per kind of device.
ROOFLINES: Mapping[str, Roofline] = {
    "cpu": Roofline(
        reference="one x86 CPU core",
        matmul=140e9,
        conv=130e9,
        attention=80e9,
        vector=40e9,
        bandwidth=3e9,
        overhead=5e-6,
        conv_pixels=4.0,
        overlap=0.0,
        cache_bandwidth=15e9,
        cache_bytes=3e6,
        resident_bytes=64e6,
    ),
    "cuda": Roofline(
        reference="a data-centre GPU",
        matmul=50e12,
        conv=100e12,
        attention=30e12,
        vector=20e12,
        bandwidth=3e12,
        overhead=10e-6,
        low_precision=10.0,
    ),
}


#: The rooflines that predict a whole step at a micro-batch count (``chunks="auto"`` weighs
#: counts with them): on the CPU, the activations' cache bandwidth is the whole batch's at
#: any count, and a kernel's fixed cost is what a node costs in a pipeline's stage (Python,
#: dispatch and autograd, forward and backward: 17 us measured per node and micro-batch,
#: ``python -m benchmarks.autoconfig --calibrate``), since smaller micro-batches measured
#: slower per sample on whole models (``benchmarks/docs/autoconfig.md``).
STEP_ROOFLINES: Mapping[str, Roofline] = {
    "cpu": replace(ROOFLINES["cpu"], overhead=8.5e-6, micro_batch_caches=False),
    # the node cost --calibrate measured on one GPU (78 us per node and micro-batch, forward
    # and backward: about two kernels), as the CPU's 17 us gave 8.5 us
    "cuda": replace(ROOFLINES["cuda"], overhead=39e-6),
}


def step_roofline_for(device_type: str) -> Roofline:
    """The roofline that predicts a whole step on a kind of device (:data:`STEP_ROOFLINES`)."""
    return STEP_ROOFLINES.get(device_type, STEP_ROOFLINES["cuda"])


def roofline_for(device_type: str) -> Roofline:
    """The roofline of a kind of device: ``"cpu"`` or ``"cuda"``; a GPU's for any other
    (a model planned on ``meta`` devices is one meant for GPUs)."""
    return ROOFLINES.get(device_type, ROOFLINES["cuda"])


def node_work(
    name: str,
    counted: Mapping[str, float],
    operands: Sequence[Operand],
    out_bytes: int,
    out_numel: int,
    *,
    backward: bool,
    view: bool,
    low_precision: bool,
    batched: bool,
    pixels: int = 0,
) -> Work:
    """The work of one node from what it computes forward: ``counted`` FLOP per unit
    (matrix products, convolutions, attention), the tensors it reads and what it writes.
    ``backward``: its output requires grad; ``view``: it aliases an input, writing nothing."""
    passes = 2.0 if backward else 1.0
    if view:
        return Work(kernels=VIEW_KERNELS * passes, batched=batched)
    flops = {unit: f * (1 + _gradient_products(operands)) for unit, f in counted.items() if f}
    if not flops:
        flops = {"vector": HEAVY_ELEMENTWISE.get(name, 1) * out_numel * passes}
    activations = [o for o in operands if not o.fixed]
    weights = [o for o in operands if o.fixed]
    moved = sum(o.bytes for o in activations) + out_bytes
    if backward:
        moved += out_bytes + 2 * sum(o.bytes for o in activations if o.grad)
    moved *= MEMORY_PASSES.get(name, 1)
    gathered = name in GATHER_OPS
    read = 0 if gathered else sum(o.bytes for o in weights) * passes
    fixed = read + sum(o.bytes for o in weights if o.grad)  # each micro-batch's gradient
    return Work(
        flops=flops,
        bytes=float(moved),
        fixed_bytes=float(fixed),
        weight_bytes=float(sum(o.bytes for o in weights)),
        grad_bytes=float(sum(o.bytes for o in weights if o.grad and o.owned)),
        pixels=float(pixels),
        kernels=passes,
        low_precision=low_precision,
        batched=batched,
    )


def attribute_work(nbytes: int, grad: bool, readers: int) -> Work:
    """The work of a ``get_attr`` of a parameter: each micro-batch, every node reading it
    adds a gradient into its ``.grad`` (where it lives, whatever stage reads it)."""
    if not grad or readers == 0:
        return Work(batched=False)
    return Work(grad_bytes=float(nbytes), weight_bytes=float(nbytes), grads=readers, batched=False)


def _gradient_products(operands: Sequence[Operand]) -> int:
    """Products backward repeats: one per matrix operand that needs a gradient (at most 2)."""
    return min(2, sum(1 for o in operands if o.grad and o.matrix))
