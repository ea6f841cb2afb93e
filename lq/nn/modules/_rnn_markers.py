"""The trace markers a ``QuantLSTM`` emits inside lq's export, so a recurrent layer is written as one loop.

Why: torch.export follows a Python loop step by step, so an LSTM over T steps became T copies of its step
(fixed to the sample's T, thousands of nodes, minutes to export). When the exporter sets the module's
``_export_as_loop`` (:func:`lq.export.trace._loop_ops.loop_mode`), :meth:`~lq.nn.QuantLSTM._direction_loop` calls,
per layer and direction:

* ``lq_export::loop_state(h0)``: a marker for "the hidden state the step reads". The layer's input quantizer
  is applied to it in the traced graph, so the quantizer writes its own Q/DQ (whatever kind it is) once, and
  :mod:`lq.export.passes._loops` moves the nodes between the marker and the op into the loop body: no second copy
  of any quantizer's numerics exists;
* ``lq_export::lstm_scan(xw, h0, c0, h_q, w_hh, b_hh, w_hr, reverse, hidden_size)``: the recurrence. ``xw``
  is the input projection of every step at once (one large GEMM outside the loop, exact because the input
  quantizer is elementwise with a fixed amax), ``h_q`` the quantized marker, ``w_hh`` / ``w_hr`` the quantized
  recurrent / projection weights;
* or, for a ``runtime_dynamic`` layer, ``lq_export::dynamic_lstm(x, h0, c0, w_ih, w_hh, b_ih, b_hh, reverse,
  hidden_size)``: the whole layer as onnxruntime's fused ``DynamicQuantizeLSTM``.

They are torch ops with shapes only (fake implementations); ``lstm_scan`` and ``dynamic_lstm`` refuse to run
eagerly. They live beside the module that emits them, and need nothing of the exporter: ``lq.nn`` never
imports ``lq.export`` (the exporter reads these, not the other way round).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["loop_state", "lstm_scan", "dynamic_lstm"]


@torch.library.custom_op("lq_export::loop_state", mutates_args=())
def loop_state(h: Tensor) -> Tensor:
    """The step's input state ``h`` (a copy); in the exported graph, the point where the loop body begins."""
    return h.clone()


@loop_state.register_fake
def _(h):
    return torch.empty_like(h)


@torch.library.custom_op("lq_export::lstm_scan", mutates_args=())
def lstm_scan(xw: Tensor, h0: Tensor, c0: Tensor, h_q: Tensor, w_hh: Tensor, b_hh: Optional[Tensor],
              w_hr: Optional[Tensor], reverse: bool, hidden_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(outputs (T, B, P), h_T (B, P), c_T (B, H))`` of one LSTM layer and direction; export marker only."""
    raise RuntimeError("lq_export::lstm_scan marks a QuantLSTM layer for lq.export.export_onnx and does not run; "
                       "call the QuantLSTM module itself")


def _layer_outputs(x, h0, c0):
    """Shapes of a recurrent marker's outputs: ``(T, B, H)`` from ``x``'s ``(T, B)``, and the final state."""
    return x.new_empty(x.shape[0], x.shape[1], h0.shape[-1]), torch.empty_like(h0), torch.empty_like(c0)


@lstm_scan.register_fake
def _(xw, h0, c0, h_q, w_hh, b_hh, w_hr, reverse, hidden_size):
    return _layer_outputs(xw, h0, c0)


@torch.library.custom_op("lq_export::dynamic_lstm", mutates_args=())
def dynamic_lstm(x: Tensor, h0: Tensor, c0: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Optional[Tensor],
                 b_hh: Optional[Tensor], reverse: bool, hidden_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(outputs (T, B, H), h_T (B, H), c_T (B, H))`` of one layer and direction run as onnxruntime's
    ``DynamicQuantizeLSTM``; export marker only (``w_ih``/``w_hh``: the quantized weights)."""
    raise RuntimeError("lq_export::dynamic_lstm marks a QuantLSTM layer for lq.export.export_onnx and does not run; "
                       "call the QuantLSTM module itself")


@dynamic_lstm.register_fake
def _(x, h0, c0, w_ih, w_hh, b_ih, b_hh, reverse, hidden_size):
    return _layer_outputs(x, h0, c0)
