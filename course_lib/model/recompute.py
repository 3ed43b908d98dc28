"""Activation recomputation: keep a segment's inputs instead of what its operators save, run it again in backward.

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost", §3) trade one more forward for memory: a
checkpointed segment keeps only its inputs, and backward recomputes the rest. Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", §5) name the two ways the field uses it:

* ``full``: every transformer layer is a segment; a layer keeps its input alone (2sbh bytes in 16 bits) and backward
  runs its whole forward again (one more forward per layer, with its tensor-parallel collectives);
* ``selective``: only the attention core, softmax(QK^T/sqrt(d)) V, is a segment; its s x s scores (5as^2b bytes
  with dropout, the part that grows with the sequence) are recomputed from the Q, K and V it keeps, at the price of
  the two attention matmuls (4bs^2h FLOPs per layer), which is small beside the layer's 24bsh^2.

:func:`recompute` is ``torch.utils.checkpoint.checkpoint`` (non-reentrant, so split backward passes such as
zero-bubble pipelines' ``torch.autograd.grad`` work) with its inputs also saved through autograd: a checkpoint holds
its inputs in a closure, out of sight of ``saved_tensors_hooks``, so the memory meter
(:class:`course_lib.ledgers.memory.MemoryMeter`) would miss exactly what recomputation keeps. Saving them (no copy)
makes the meter count them for as long as the segment's backward needs them. The run in backward is a ``recompute`` span
on the rank's timeline (:mod:`course_lib.ledgers.trace`), carrying the FLOPs it cost; its collectives are tagged
``recomputed``. PyTorch's checkpoint stops the
recomputation once it has rebuilt the last tensor the segment saved (``set_checkpoint_early_stop``), so what
follows it (a layer's closing collective) does not run again.

The tiny GPT uses it through ``GPTConfig(recompute=...)``; :func:`apply` does the same to a student's model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.ledgers import trace
from course_lib.model.config import GPTConfig, check_recompute


class _KeepInputs(torch.autograd.Function):
    """Identity that saves its inputs for backward: what a checkpointed segment keeps, made visible to autograd."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.save_for_backward(*inputs)
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def recompute(fn: Callable[..., torch.Tensor], *inputs) -> torch.Tensor:
    """``fn(*inputs)``, keeping only ``inputs`` for backward, where ``fn`` runs again to rebuild what it saved."""
    if not torch.is_grad_enabled():
        return fn(*inputs)
    where = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
    args = list(inputs)
    for i, kept in zip(where, _KeepInputs.apply(*(inputs[i] for i in where)), strict=True):
        args[i] = kept
    runs = []

    def segment(*x):
        if not runs:  # the forward itself
            runs.append(trace.current_tags())
            return fn(*x)
        # Backward running it again, under the forward's tags (step, layer, microbatch): its FLOPs and collectives.
        with trace.tags(**runs[0]), trace.span("recompute", recomputed=True):
            return fn(*x)

    return checkpoint(segment, *args, use_reentrant=False)


def extra_flops_per_layer(cfg: GPTConfig, micro_batch: int, tp: int = 1) -> int:
    """Matrix-product FLOPs that backward spends recomputing one dense layer of the tiny GPT for one microbatch of
    ``micro_batch`` sequences, on one of ``tp`` tensor-parallel ranks (each holds 1/t of every matmul), as torch's
    FLOP counter counts them: ``full`` 2bsh^2 (3 + 1 + f) + 4bs^2 h, every matmul of the layer but the MLP's second
    (f = ``ffn_mult``), whose input is the last tensor the layer saves, so PyTorch's checkpoint stops before it;
    ``selective`` 2bs^2 h, Q K^T alone (the product with V saves its inputs before it runs). Megatron-LM's
    recomputation has no early stop and runs the whole forward again, 2bsh^2 (4 + 2f) + 4bs^2 h."""
    b, s, h = micro_batch, cfg.seq, cfg.d_model
    if cfg.recompute == "full":
        return (2 * b * s * h * h * (4 + cfg.ffn_mult) + 4 * b * s * s * h) // tp
    return 2 * b * s * s * h // tp if cfg.recompute == "selective" else 0


def _recompute_forward(module: nn.Module) -> None:
    """Make ``module``'s forward a recomputed segment, keeping its parameters' names (hooks still run)."""
    forward = module.forward
    module.forward = lambda *inputs, **kwargs: recompute(lambda *x: forward(*x, **kwargs), *inputs)


def _is_attention(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or name.rsplit(".", 1)[-1] in ("attn", "attention", "self_attn")


def apply(model: nn.Module, recompute: str) -> nn.Module:
    """Recompute a student's model as ``recompute`` says, in place: ``full`` makes each layer of its layer lists
    (the modules in its ``nn.ModuleList``s) a segment; ``selective`` each attention module (an
    ``nn.MultiheadAttention``, or a submodule named ``attn``, ``attention`` or ``self_attn``) whole, with its
    projections, the closest a model the course does not know gets to Korthikanti's selective recompute."""
    check_recompute(recompute)
    if recompute == "none":
        return model
    if recompute == "full":
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        if not lists:
            raise ValueError(
                f"recompute='full' makes each layer of the model a segment, but your {type(model).__name__} keeps "
                "no layers in an nn.ModuleList: put them in one, or use recompute='none'"
            )
        for layers in lists:
            for layer in layers:
                _recompute_forward(layer)
        return model
    found = [name for name, m in model.named_modules() if name and _is_attention(name, m)]
    if not found:
        raise ValueError(
            f"recompute='selective' recomputes the attention scores, but your {type(model).__name__} has no "
            "attention module (an nn.MultiheadAttention, or a submodule named attn, attention or self_attn): use "
            "recompute='full' or 'none'"
        )
    for name in found:
        if not any(name.startswith(outer + ".") for outer in found):  # the outermost of nested ones
            _recompute_forward(model.get_submodule(name))
    return model
