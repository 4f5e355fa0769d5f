"""A model's linear layers with their weights packed once for the CPU's matrix kernels.

A speculative step on a CPU verifies a few tokens at once, and there PyTorch's default linear
layer is at its worst: one token takes a matrix-vector product, but two to a dozen take a
general matrix product that costs far more than the extra rows' arithmetic. On a 2-core CPU,
SmolLM2-135M in float32 against a 512-token cache took 66 ms for one token, 106 ms for two and
128 ms for three (``CostCurve.measure``), so a draft of one or two tokens had to be very likely
to pay at all. With the weights kept as oneDNN tensors (``Tensor.to_mkldnn``), which oneDNN's
matrix product reads as they are, the same forwards took 59, 68 and 78 ms, side by side:
verifying a few tokens costs little more than decoding one, as on a GPU. Such a model wants
OpenMP's default wait policy: with ``OMP_WAIT_POLICY=PASSIVE`` its threads sleep between the
model's many small operations and it decodes at half the speed.

Only CPU float32 models are packed, and only where PyTorch has oneDNN; the model is changed in
place, for inference only (packed weights take no gradient). A tied output layer gets a packed
copy of its own (the embedding it shares weights with stays as it is). Every method that runs
on the model runs on the packed layers, plain decoding included.
"""

from __future__ import annotations

import torch


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


class PackedLinear(torch.nn.Module):
    """``linear`` with its weight (and bias) kept in oneDNN's layout: the same output, one
    packing for every call. For inference: the packed weight takes no gradient.

    >>> torch.manual_seed(0) and None
    >>> linear = torch.nn.Linear(8, 4)
    >>> x = torch.randn(2, 3, 8)
    >>> torch.allclose(PackedLinear(linear)(x), linear(x), atol=1e-6)
    True
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to_mkldnn())
        bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.mkldnn_linear(x.to_mkldnn(), self.weight, self.bias).to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`PackedLinear`; the
    number replaced (0 where :func:`packable` says no).

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
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
