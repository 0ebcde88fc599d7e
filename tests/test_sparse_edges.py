"""Edges of the sparse format's geometry and convolution entry points: modules that are no plain convolution, and
channel groups that do not divide the channels (each refused with an error naming the field, not torch's)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from unsparse import SparseFileError, create_model, load_sparse, save_sparse, sparsify
from unsparse.models import registry
from unsparse.runtime import SparseConv
from unsparse.sparse import SparseFormatError, UniformCSR
from unsparse.sparse.functional import sparse_conv1d, sparse_conv2d
from unsparse.sparse.geometry import ConvGeometry


@pytest.mark.parametrize("conv", [nn.ConvTranspose2d(4, 8, 3, stride=2), nn.ConvTranspose1d(4, 8, 3),
                                  nn.Conv3d(2, 2, 3)], ids=lambda conv: type(conv).__name__)
def test_from_module_refuses_a_module_that_is_no_conv1d_or_conv2d(conv):
    """A transposed conv was described as a forward conv of its stride (a ConvTranspose1d as a 2-D one), and a
    Conv3d was refused for its 'stride' (three values), which is not what is wrong with it."""
    with pytest.raises(TypeError, match=rf"^conv: {type(conv).__name__} is not an nn\.Conv1d or nn\.Conv2d"):
        ConvGeometry.from_module(conv)


def test_from_module_reads_a_conv_subclass():
    """A subclass (here the lazy conv, once its weight has a shape) is a Conv2d, and is described as one."""
    conv = nn.LazyConv2d(8, 3, stride=2, groups=2)
    conv(torch.zeros(1, 4, 9, 9))
    assert ConvGeometry.from_module(conv) == ConvGeometry((2, 2), 0, 1, 2, 2)


@pytest.mark.parametrize(("attribute", "channels"), [("in_channels", 6), ("out_channels", 9)])
def test_from_module_refuses_groups_that_do_not_divide_the_channels(attribute, channels):
    """torch checks the channels against ``groups`` when a conv is built, not when an attribute changes later; such a
    conv reached torch's RuntimeError at its first forward."""
    conv = nn.Conv2d(8, 8, 3, groups=4)
    setattr(conv, attribute, channels)
    with pytest.raises(SparseFormatError, match=rf"^groups: 4 does not divide the {attribute} \({channels}\)"):
        ConvGeometry.from_module(conv)


@pytest.mark.parametrize("backend", ["reference", "dense_cpu"])
@pytest.mark.parametrize("dims", [1, 2])
def test_a_convolution_with_groups_that_do_not_divide_the_output_channels_is_refused(backend, dims):
    """A weight of 8 output channels under groups=3 (a hand-made geometry) reached torch's RuntimeError ('expected
    weight to be divisible by 3 at dimension 0') on every backend; a layer built so is refused when it is built."""
    csr = UniformCSR.from_dense(torch.randn(8, 2, *(3,) * dims))
    x = torch.randn(1, 6, *(7,) * dims)
    convolve = sparse_conv2d if dims == 2 else sparse_conv1d
    with pytest.raises(SparseFormatError, match=r"^groups: 3 does not divide the out_channels \(8\)"):
        convolve(x, csr, groups=3, backend=backend)
    with pytest.raises(SparseFormatError, match=r"^groups: 3 does not divide the out_channels \(8\)"):
        SparseConv(csr, None, ConvGeometry.of(groups=3, spatial_dims=dims), backend)


def test_a_grouped_convolution_whose_groups_divide_the_channels_runs_as_torch_does():
    """The check refuses only what torch refuses: groups=2 over 8 output channels computes as ``F.conv2d``."""
    weight = torch.randn(8, 3, 3, 3, dtype=torch.float64)
    x = torch.randn(2, 6, 7, 7, dtype=torch.float64)
    expected = torch.nn.functional.conv2d(x, weight, groups=2, padding=1)
    assert torch.allclose(sparse_conv2d(x, UniformCSR.from_dense(weight), groups=2, padding=1), expected)


class GroupedConv(nn.Module):
    """One Conv2d of 4 to 8 channels in 2 groups, its ``groups`` set to ``groups`` after torch built it (which is when
    torch checks the channels)."""

    def __init__(self, groups: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, groups=2)
        self.conv.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_a_file_and_an_architecture_whose_groups_do_not_divide_the_channels_are_refused(tmp_path, monkeypatch):
    """A file whose geometry says groups=3 for a conv of 4 and 8 channels matched an architecture whose conv had its
    ``groups`` changed to 3 after it was built: the file loaded, and the first forward raised torch's RuntimeError."""
    monkeypatch.setitem(registry._MODELS, "grouped_conv", GroupedConv)
    path = save_sparse(sparsify(create_model("grouped_conv")), tmp_path / "grouped.safetensors")
    with safe_open(str(path), "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (safe_open is not a dict)
        metadata = json.loads(file.metadata()["unsparse"])
    metadata["layers"]["conv"]["geometry"]["groups"] = 3
    metadata["model"]["kwargs"] = {"groups": 3}
    path.write_bytes(save(tensors, metadata={"unsparse": json.dumps(metadata)}))
    with pytest.raises(SparseFileError, match=r"^layers\.conv: the architecture's convolution: groups: 3 does not "
                                              r"divide the in_channels \(4\)"):
        load_sparse(path)
