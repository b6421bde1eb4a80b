"""Cost model: every node priced, sizes match the real tensors, the model's state untouched."""

from __future__ import annotations

import functools
import resource
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from models import ZOO, Case, ResidualMLP
from torch import nn

from fxpipe.errors import FxPipeError
from fxpipe.ir import CostTable, NodeCost
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.trace.tracing import trace

ALL = list(ZOO.values())
NAMING_OPS = ("placeholder", "output", "get_attr")


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def traced(name: str) -> tuple[nn.Module, Any]:
    case = ZOO[name]
    model = case.build().eval()
    args, kwargs = case.example(case.batch)
    return model, trace(model, args, kwargs, tracer=case.tracer)


def real_outputs(gm: fx.GraphModule, values: tuple[Any, ...]) -> dict[str, Any]:
    """The value every node of ``gm`` produces on ``values``, run for real."""
    seen: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            seen[n.name] = out
            return out

    with torch.no_grad():
        Recorder(gm).run(*values)
    return seen


def fetch(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.name)
def test_every_node_gets_a_cost_and_real_output_bytes(case: Case) -> None:
    _, t = traced(case.name)
    gm = t.graph_module
    code = gm.code
    costs = estimate_costs(gm, t.example_values, mode="flops")
    assert isinstance(costs, CostTable) and costs.mode == "flops"
    assert costs.batch_size == case.batch
    assert list(costs.nodes) == [n.name for n in gm.graph.nodes]
    assert all(isinstance(c, NodeCost) for c in costs.nodes.values())
    assert gm.code == code  # the graph is not modified
    real = real_outputs(gm, t.example_values)
    for node in gm.graph.nodes:
        c, out = costs.nodes[node.name], real[node.name]
        assert c.cost >= 0.0, node.name
        if node.op in ("placeholder", "output"):
            assert c.cost == 0.0
        assert c.is_tensor == isinstance(out, torch.Tensor), node.name
        if isinstance(out, torch.Tensor):
            assert c.output_bytes == nbytes(out), node.name
    compute = [n for n in gm.graph.nodes if n.op not in NAMING_OPS]
    assert sum(costs.nodes[n.name].cost for n in compute) > 0


def test_naming_nodes_save_nothing_for_backward() -> None:
    _, t = traced("mlp_residual")
    costs = estimate_costs(t.graph_module, t.example_values, mode="flops")
    for node in t.graph_module.graph.nodes:
        if node.op in NAMING_OPS:
            assert costs.nodes[node.name].saved_bytes == 0, node.name


def _linear_cost(batch: int, d_in: int, d_out: int, *, as_module: bool) -> float:
    layer = nn.Linear(d_in, d_out)
    model = nn.Sequential(layer) if as_module else layer
    t = trace(model, (torch.randn(batch, d_in),), tracer="fx")
    costs = estimate_costs(t.graph_module, t.example_values, mode="flops")
    ops = [n for n in t.graph_module.graph.nodes if n.op not in NAMING_OPS]
    assert len(ops) == 1
    return costs.nodes[ops[0].name].cost


@pytest.mark.parametrize("as_module", [True, False], ids=["call_module", "call_function"])
@pytest.mark.parametrize("batch, d_in, d_out", [(128, 256, 512), (256, 384, 128)])
def test_flops_price_a_linear_as_forward_plus_backward(
    as_module: bool, batch: int, d_in: int, d_out: int
) -> None:
    cost = _linear_cost(batch, d_in, d_out, as_module=as_module)
    assert cost == pytest.approx(3 * 2 * batch * d_in * d_out, rel=0.05)


class Elementwise(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.relu(x)
        b = a + y
        c = b * 0.5
        d = torch.sigmoid(c)
        e = F.gelu(d)
        f = F.layer_norm(e, e.shape[-1:])
        g = torch.softmax(f, dim=-1)
        return g - x


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_flops_give_element_wise_ops_a_cost_growing_with_size(device: str) -> None:
    small = torch.randn(8, 64, device=device)
    big = torch.randn(32, 64, device=device)
    model = Elementwise()
    t = trace(model, (small, small), tracer="fx")
    ops = [n.name for n in t.graph_module.graph.nodes if n.op == "call_function"]
    ops = [n for n in ops if not n.startswith("getattr") and not n.startswith("getitem")]
    assert len(ops) >= 8
    c_small = estimate_costs(t.graph_module, (small, small), mode="flops").nodes
    c_big = estimate_costs(t.graph_module, (big, big), mode="flops").nodes
    for name in ops:
        assert c_small[name].cost > 0, name
        assert c_big[name].cost > c_small[name].cost, name


def _priced(model: nn.Module, x: torch.Tensor) -> CostTable:
    t = trace(model, (x,), tracer="fx")
    return estimate_costs(t.graph_module, t.example_values, mode="flops")


def test_flops_on_a_meta_model_equal_those_of_the_real_model() -> None:
    with torch.device("meta"):
        meta_model = ResidualMLP()
    real = _priced(ResidualMLP(), torch.randn(8, 32))
    meta = _priced(meta_model, torch.randn(8, 32, device="meta"))
    assert meta.nodes == real.nodes
    assert all(p.is_meta for p in meta_model.parameters())


def test_flops_on_a_huge_meta_model_take_no_real_memory() -> None:
    width = 16384  # 1 GiB of float32 weights per layer if it were real
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        x = torch.randn(64, width)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    costs = _priced(model, x)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 512 * 1024, f"peak memory grew by {grown} KiB"
    layer = costs.nodes["_0"]
    assert layer.cost == pytest.approx(6 * 64 * width * width, rel=0.05)
    assert layer.param_bytes == (width * width + width) * 4
    assert layer.output_bytes == 64 * width * 4
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("name", ["mlp_residual", "transformer", "resnet", "shared_module"])
def test_params_mode_prices_parameter_bytes(name: str) -> None:
    model, t = traced(name)
    gm = t.graph_module
    costs = estimate_costs(gm, t.example_values, mode="params")
    assert costs.mode == "params"
    for node in gm.graph.nodes:
        if node.op == "call_module":
            held = list(gm.get_submodule(str(node.target)).parameters())
        elif node.op == "get_attr":
            value = fetch(gm, str(node.target))
            held = [value] if isinstance(value, nn.Parameter) else []
        else:
            held = []
        want = sum(nbytes(p) for p in held)
        assert costs.nodes[node.name].cost == want, node.name
        assert costs.nodes[node.name].param_bytes == want, node.name
    if name != "shared_module":  # there one module is called twice, so priced twice
        total = sum(nbytes(p) for p in model.parameters())  # tied weights once
        assert sum(c.cost for c in costs.nodes.values()) == total


def test_a_callable_cost_is_used_as_given() -> None:
    _, t = traced("bn_dropout_buffers")
    gm = t.graph_module
    seen: list[fx.Node] = []

    def cost(node: fx.Node) -> float:
        seen.append(node)
        return 1.5 + len(node.name) + 10.0 * node.op.startswith("call_module")

    costs = estimate_costs(gm, t.example_values, mode=cost)
    assert costs.mode == "custom"
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert {id(n) for n in seen} == {id(n) for n in nodes}  # the graph's own nodes
    for node in nodes:
        assert costs.nodes[node.name].cost == cost(node), node.name
    real = real_outputs(gm, t.example_values)  # bytes are still the real sizes
    for node in nodes:
        if isinstance(real[node.name], torch.Tensor):
            assert costs.nodes[node.name].output_bytes == nbytes(real[node.name])


def test_time_mode_is_positive_and_leaves_grads_buffers_and_rng_alone() -> None:
    case = ZOO["bn_dropout_buffers"]  # BatchNorm, dropout, a buffer, in-place ops
    model = case.build().train()
    args, kwargs = case.example(case.batch)
    t = trace(model, args, kwargs, tracer="fx")
    gm = t.graph_module
    code = gm.code
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = [(p, p.detach().clone()) for p in model.parameters()]
    torch.manual_seed(321)
    rng = torch.get_rng_state()
    costs = estimate_costs(gm, t.example_values, mode="time", repeats=1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert costs.mode == "time"
    assert all(p.grad is None for p, _ in params)
    assert all(torch.equal(p, v) for p, v in params)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert model.training and gm.code == code
    assert list(costs.nodes) == [n.name for n in gm.graph.nodes]
    for node in gm.graph.nodes:
        if node.op not in NAMING_OPS:
            assert costs.nodes[node.name].cost > 0, node.name


@pytest.mark.parametrize("name", ["transformer", "llama"])
def test_time_mode_on_another_device_copies_modules_there_and_moves_nothing(name: str) -> None:
    """Profiling on a stage's device while the model lives on the CPU (a CUDA stage in
    practice; the meta device here, which runs every op without data): weights, buffers and
    device constants (the Llama's position table) go to that device, the model stays."""
    model, t = traced(name)
    before = {k: (v.device, v.clone()) for k, v in model.state_dict().items()}
    costs = estimate_costs(
        t.graph_module, t.example_values, mode="time", device=torch.device("meta"), repeats=1
    )
    flops = estimate_costs(t.graph_module, t.example_values, mode="flops")
    for key, value in model.state_dict().items():
        assert value.device == before[key][0] and torch.equal(value, before[key][1]), key
    assert list(costs.nodes) == list(flops.nodes)
    for node_name, cost in costs.nodes.items():
        assert cost.output_bytes == flops.nodes[node_name].output_bytes, node_name


def test_a_node_that_fails_to_run_is_an_fxpipe_error_naming_it() -> None:
    class Mismatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w  # x has 4 features: fails only when run

    x = torch.randn(2, 4)
    t = trace(Mismatch(), (x,), {}, tracer="fx")
    with pytest.raises(FxPipeError, match="matmul"):
        estimate_costs(t.graph_module, t.example_values, mode="time")


# ------------------------------------------------------------------ pricing never refuses


class BufferBatchNorm(nn.Module):
    """Calls ``F.batch_norm`` directly on its own buffers in training mode, as the
    pre-activation ResNets of timm do."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y = F.batch_norm(
            y, self.running_mean, self.running_var, self.weight, self.bias, training=True
        )
        return F.relu(y)


class TokenRouter(nn.Module):
    """A mixture-of-experts router that counts the tokens sent to each expert with
    ``histc`` and turns the counts into integer offsets with ``cumsum``, as the expert
    layers of Hugging Face MoE decoders do on CPU."""

    def __init__(self, width: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.experts = experts
        self.gate = nn.Linear(width, experts)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        chosen = logits.argmax(-1)
        counts = torch.histc(chosen.float(), bins=self.experts, min=0, max=self.experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        load = offsets.float().max() / x.shape[0]
        return self.proj(x) * logits.softmax(-1).amax(-1, keepdim=True) + load


@pytest.mark.parametrize(
    "model, x",
    [
        (BufferBatchNorm(), torch.randn(4, 3, 8, 8)),
        (TokenRouter(), torch.randn(12, 16)),
    ],
    ids=["batch_norm_on_buffers", "histc_cumsum_router"],
)
def test_time_prices_nodes_autograd_cannot_differentiate_where_the_profiler_tries(
    model: nn.Module, x: torch.Tensor
) -> None:
    """The profiler used to make every float input require grad: ``running_mean`` of
    ``F.batch_norm`` and the float counts ``cumsum(..., dtype=int32)`` reads then refused
    (``StageError``). Every node gets a positive time now; the model's state is untouched."""
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    t = trace(model, (x,), tracer="fx")
    costs = estimate_costs(t.graph_module, t.example_values, mode="time", repeats=1)
    for node in t.graph_module.graph.nodes:
        if node.op not in NAMING_OPS:
            assert costs.nodes[node.name].cost > 0, node.name
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert all(p.grad is None for p in model.parameters())


class NoBackward(torch.autograd.Function):
    """Doubles its input; its backward is not implemented."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("no backward")


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return NoBackward.apply(x)  # type: ignore[no-any-return]


fx.wrap("_doubled")


class Undifferentiable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _doubled(self.fc(x)).relu()


def test_time_falls_back_to_forward_only_for_a_node_without_backward() -> None:
    """A node whose backward raises is timed forward only (3x that time) instead of failing
    the pricing; the nodes after it are timed as usual."""
    model, x = Undifferentiable(), torch.randn(256, 16)
    t = trace(model, (x,), tracer="fx")
    node = next(n for n in t.graph_module.graph.nodes if n.target is _doubled)
    costs = estimate_costs(t.graph_module, t.example_values, mode="time", repeats=3)
    assert costs.nodes[node.name].cost > 0
    assert costs.nodes["relu"].cost > 0


def _cpu_only(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        raise RuntimeError(f"this kernel runs on cpu only, not on {x.device}")
    return x.sin()


fx.wrap("_cpu_only")


class CpuKernel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(_cpu_only(self.fc(x)))


def test_time_gives_a_node_that_cannot_run_on_the_profiling_device_its_roofline_cost() -> None:
    """Profiled on another device (``meta`` here) where one node cannot run: that node
    costs what the roofline says for that device, and the nodes after it are still timed."""
    t = trace(CpuKernel(), (torch.randn(8, 16),), tracer="fx")
    gm, values = t.graph_module, t.example_values
    meta = torch.device("meta")
    timed = estimate_costs(gm, values, mode="time", device=meta, repeats=1)
    analytic = estimate_costs(gm, values, mode="roofline", device=meta)
    node = next(n for n in gm.graph.nodes if n.target is _cpu_only)
    assert timed.nodes[node.name].cost == analytic.nodes[node.name].cost > 0
    assert timed.nodes[node.name].output_bytes == 8 * 16 * 4
    after = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes[0]
    assert after in node.users or any(after in u.users for u in node.users)
    assert timed.nodes[after.name].cost > 0


class _ReadsValue(nn.Module):
    """Reads a tensor's value into Python and computes with it (as XLM's length check does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * x.abs().max().item()


def test_flops_falls_back_to_real_values_for_value_dependent_nodes() -> None:
    # Fake tensors hold no values: the example's real ones price the graph instead.
    model = _ReadsValue()
    gm = fx.symbolic_trace(model)
    x = torch.randn(4, 6)
    table = estimate_costs(gm, (x,), mode="flops")
    assert {n.name for n in gm.graph.nodes if n.op != "output"} <= set(table.nodes)
    assert table.nodes["a"].cost > 0


@torch.fx.wrap
def _clip_sizes(sizes: list[int], limits: list[int]) -> list[int]:
    """Writes into its list argument, as torchvision's 3-D Swin window sizing does."""
    for i, limit in enumerate(limits):
        sizes[i] = min(sizes[i], limit)
    return sizes


class _ListWriter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = _clip_sizes([4, 9], [x.shape[0], x.shape[1]])
        return self.a(x)[: size[0], : size[1]]


@pytest.mark.parametrize("mode", ["flops", "params", "time"])
def test_a_leaf_function_may_write_into_its_list_argument(mode: str) -> None:
    model = _ListWriter()
    x = torch.randn(4, 6)
    gm = fx.symbolic_trace(model)
    table = estimate_costs(gm, (x,), mode=mode)
    assert set(table.nodes) >= {n.name for n in gm.graph.nodes if n.op != "output"}
