"""What the model tests share."""

import torch


def assert_matches_with_grads(layer, x, out, ref, tol: tuple[float, float], grad_tol: tuple[float, float]) -> None:
    """out equals ref within tol (rtol, atol), and the gradients of out.square().sum() with respect to x and every
    parameter of `layer` equal ref's within grad_tol."""
    torch.testing.assert_close(out, ref, rtol=tol[0], atol=tol[1])
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *layer.parameters()])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=grad_tol[0], atol=grad_tol[1])
