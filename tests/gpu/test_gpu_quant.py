"""Activation-quantized models on CUDA (paper 004 §4's fp16 and fixed-point activations) in a CUDA graph, as the
plan check and the end-to-end benchmark time them."""

from __future__ import annotations

import pytest
import torch

from unsparse import create_model, sparsify
from unsparse.quant.activations import ActivationSpec, attach_activation_quantizers, calibrate
from unsparse.runtime import set_backend
from unsparse.runtime.comparator import relative_error, tolerance
from unsparse.runtime.timing import capture_graph

CUDA = torch.device("cuda")


@pytest.mark.parametrize("backend", ["direct", "cudnn"])
@pytest.mark.parametrize("activations", ["fp16", "fixed"])
def test_an_activation_quantized_model_replays_in_a_cuda_graph(activations: str, backend: str) -> None:
    """A quantizer that reads a number back to the host at every forward (a saturation count, a step read from its
    level) makes the capture fail (cudaErrorStreamCaptureInvalidated); a replay must recompute the eager output."""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(5)
    model = sparsify(create_model("vgg_small", width=4).eval())
    x = torch.randn(8, 1, 28, 28)
    spec = ActivationSpec(format=activations, calibration_batches=1)
    levels = calibrate(model, [(x, torch.zeros(8))], spec, progress=False) if activations == "fixed" else {}
    for name, quantizer in attach_activation_quantizers(model, spec).items():
        if activations == "fixed":
            quantizer.saturation.fill_(levels[name])
    model, x = set_backend(model.to(CUDA), backend), x.to(CUDA)
    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        eager = model(x)
        graph = capture_graph(lambda: outputs.append(model(x)))
        captured = outputs[-1]
        captured.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    assert relative_error(captured.double(), eager.double()) <= tolerance(torch.float32)
