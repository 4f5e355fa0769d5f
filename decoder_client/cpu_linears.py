"""A model's linear layers on the CPU's matrix kernels, the fastest one for each forward size.

A speculative step on a CPU verifies a few tokens at once, and there PyTorch's default linear
layer is at its worst: one token takes a matrix-vector product, but two to a dozen take a
general matrix product that costs far more than the extra rows' arithmetic. On a 2-core CPU,
SmolLM2-135M in float32 against a 512-token cache took 66 ms for one token, 106 ms for two and
128 ms for three (``CostCurve.measure``), so a draft of one or two tokens had to be very likely
to pay at all. With the weights kept as oneDNN tensors (``Tensor.to_mkldnn``), which oneDNN's
matrix product reads as they are, the same forwards took 59, 68 and 78 ms, side by side.

No one kernel is the fastest at every size. For two to five rows, the product taken the other
way round, the weight times the rows' transpose (BLAS sees a tall matrix times a few columns),
costs no more than one row's forward: on a 2-core AMD EPYC, whole forwards of 33.6, 35.8 and
33.1 ms for two, three and four tokens against 38.9, 40.1 and 40.4 packed, and 34.4 for one token
packed (the transposed product is slower there); from six rows on, oneDNN's packed product is
faster (44.6 against 48.5 ms at eight, 97 against 143 at 64).
Which is faster where depends on the CPU, so :func:`tune_linears` times whole verification
forwards of each size with each kernel and keeps the faster per size; the kernel a layer never
runs has its weights released. Kernels differ only in rounding (float32 sums in another order).

Such a model wants OpenMP's default wait policy: with ``OMP_WAIT_POLICY=PASSIVE`` its threads
sleep between the model's many small operations and it decodes at half the speed.

Only CPU float32 models are packed, and only where PyTorch has oneDNN; the model is changed in
place, for inference only (packed weights take no gradient). A tied output layer gets a packed
copy of its own (the embedding it shares weights with stays as it is). Every method that runs
on the model runs on these layers, plain decoding included.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from decoder_client.forward_timing import SIZES, forward_seconds

logger = logging.getLogger(__name__)

PACKED, DENSE = "packed", "dense"  # oneDNN's packed product; the loaded weight times the rows' transpose
# Forward sizes a kernel table spells out; larger ones take the largest's kernel.
MAX_ROWS = 4096


class RowKernels:
    """Which kernel the linear layers of one model run for an input of ``rows`` rows (the
    tokens of a forward), shared by all of them: packed everywhere until told otherwise.

    ``set`` takes the kernel at some sizes; a size in between takes the kernel of the largest
    given size below it.

    >>> k = RowKernels()
    >>> k.set({1: PACKED, 2: DENSE, 6: PACKED})
    >>> [k.kernel(n) for n in (1, 2, 5, 6, 100)]
    ['packed', 'dense', 'dense', 'packed', 'packed']
    """

    def __init__(self) -> None:
        self.available = {PACKED, DENSE}
        self.tuned = False  # set by tune_linears: measured once per model
        self._choice: dict[int, str] = {1: PACKED}
        self._dense = [False] * (MAX_ROWS + 1)

    def set(self, choice: Mapping[int, str]) -> None:
        if not choice or 1 not in choice or min(choice) < 1:
            raise ValueError(f"a kernel table needs positive sizes starting at 1, got {sorted(choice)}")
        missing = set(choice.values()) - self.available
        if missing:
            raise ValueError(f"kernels {sorted(missing)} are not available (released: {sorted(self.available)} left)")
        self._choice = dict(sorted(choice.items()))
        dense, current = [False] * (MAX_ROWS + 1), False
        for rows in range(1, MAX_ROWS + 1):
            if rows in self._choice:
                current = self._choice[rows] == DENSE
            dense[rows] = current
        self._dense = dense

    def kernel(self, rows: int) -> str:
        return DENSE if self.dense(rows) else PACKED

    def dense(self, rows: int) -> bool:
        return self._dense[min(rows, MAX_ROWS)]

    def table(self) -> dict[int, str]:
        """The kernel at each size given to :meth:`set`."""
        return dict(self._choice)


class PackedLinear(torch.nn.Module):
    """``linear`` on the kernel its :class:`RowKernels` picks for each input's row count: its
    weight (and bias) kept in oneDNN's layout, packed once, and as loaded. The same output up to
    rounding. For inference: the weights take no gradient.

    >>> torch.manual_seed(0) and None
    >>> linear = torch.nn.Linear(8, 4)
    >>> x = torch.randn(2, 3, 8)
    >>> torch.allclose(PackedLinear(linear)(x), linear(x), atol=1e-6)
    True
    >>> kernels = RowKernels()
    >>> kernels.set({1: DENSE})
    >>> torch.allclose(PackedLinear(linear, kernels)(x), linear(x), atol=1e-6)
    True
    """

    def __init__(self, linear: torch.nn.Linear, kernels: RowKernels | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.has_bias = linear.bias is not None
        self.kernels = kernels if kernels is not None else RowKernels()
        self.dense_weight: torch.Tensor | None = linear.weight.detach()  # shared with the loaded layer, not copied
        self.dense_bias: torch.Tensor | None = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("weight", linear.weight.detach().to_mkldnn())
        bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.dense_weight is not None and self.kernels.dense(rows):
            out = (self.dense_weight @ x.reshape(rows, self.in_features).t()).t()
            if self.dense_bias is not None:
                out = out + self.dense_bias
            return out.reshape(*x.shape[:-1], self.out_features)
        return torch.ops.aten.mkldnn_linear(x.to_mkldnn(), self.weight, self.bias).to_dense()

    def release(self, kernel: str) -> None:
        """Drop the weights ``kernel`` runs on (its :class:`RowKernels` no longer picks it)."""
        if kernel == DENSE:
            self.dense_weight = self.dense_bias = None
        else:
            self.weight = self.bias = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}"


def packable(model: torch.nn.Module) -> bool:
    """Whether :func:`pack_linears` would change ``model``: on the CPU, in float32, with oneDNN.

    >>> packable(torch.nn.Linear(4, 4)) == torch.backends.mkldnn.is_available()
    True
    >>> packable(torch.nn.Linear(4, 4).to(torch.bfloat16))
    False
    """
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or first.dtype != torch.float32:
        return False
    return bool(torch.backends.mkldnn.is_available())


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`PackedLinear`, all
    sharing one :class:`RowKernels`; the number replaced (0 where :func:`packable` says no).

    >>> torch.manual_seed(0) and None
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    >>> x = torch.randn(3, 8)
    >>> before = net(x)
    >>> pack_linears(net) == (2 if torch.backends.mkldnn.is_available() else 0)
    True
    >>> torch.allclose(net(x), before, atol=1e-5)
    True
    """
    if not packable(model):
        return 0
    model.eval()
    kernels, replaced = RowKernels(), 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child, kernels))
                replaced += 1
    return replaced


def row_kernels(model: torch.nn.Module) -> list[RowKernels]:
    """The kernel tables of ``model``'s packed linear layers (one per :func:`pack_linears` call)."""
    seen: dict[int, RowKernels] = {}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            seen.setdefault(id(module.kernels), module.kernels)
    return list(seen.values())


def kernel_table(model: torch.nn.Module) -> dict[int, str]:
    """The kernel ``model``'s packed linear layers run at each size (:meth:`RowKernels.table`;
    empty when nothing is packed)."""
    tables = row_kernels(model)
    return tables[0].table() if tables else {}


def tune_linears(
    model: torch.nn.Module, *, context: int = 512, repeats: int = 3, margin: float = 0.02
) -> dict[int, str]:
    """Time whole verification forwards of each size (:data:`SIZES`) with every packed linear
    layer of ``model`` on each kernel, keep per size the dense product where it is faster by
    more than ``margin`` (else the packed one), and release the weights of a kernel no size
    takes. Measured once per table: a second call returns the table. Returns the table (empty
    when nothing is packed)."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must lie in [0, 1), got {margin}")
    tables = [t for t in row_kernels(model) if not t.tuned]
    if not tables:
        return kernel_table(model)

    def everywhere(kernel: str) -> None:
        for t in tables:
            t.set({1: kernel})

    variants = {PACKED: lambda: everywhere(PACKED), DENSE: lambda: everywhere(DENSE)}
    seconds = forward_seconds(model, SIZES, context=context, repeats=repeats, variants=variants)
    choice = {n: DENSE if seconds[DENSE][n] < (1.0 - margin) * seconds[PACKED][n] else PACKED for n in SIZES}
    for t in tables:
        t.set(choice)
    unused = {PACKED, DENSE} - set(choice.values())
    for module in model.modules():
        if isinstance(module, PackedLinear) and any(module.kernels is t for t in tables):
            for kernel in unused:
                module.release(kernel)
    for t in tables:
        t.available -= unused
        t.tuned = True
    logger.info(
        "linear kernels by forward size: %s (ms packed / dense: %s)",
        choice,
        {n: f"{seconds[PACKED][n] * 1e3:.1f}/{seconds[DENSE][n] * 1e3:.1f}" for n in SIZES},
    )
    return choice
