"""Torch-side placeholders that let ``export_onnx`` write a recurrent layer as one ONNX ``Scan``, not unrolled.

Why: torch.export follows a Python loop step by step, so an LSTM over T steps became T copies of its step
(fixed to the sample's T, thousands of nodes, minutes to export). Inside lq's own export a ``QuantLSTM``
(:meth:`~lq.nn.QuantLSTM._direction_loop`) emits, per layer and direction, instead:

* ``lq_export::loop_state(h0)``: a marker for "the hidden state the step reads". The layer's input quantizer
  is applied to it in the traced graph, so the quantizer writes its own Q/DQ (whatever kind it is) once, and
  :mod:`lq.export._loops` moves the nodes between the marker and the op into the loop body: no second copy
  of any quantizer's numerics exists here;
* ``lq_export::lstm_scan(xw, h0, c0, h_q, w_hh, b_hh, w_hr, reverse, hidden_size)``: the recurrence. ``xw``
  is the input projection of every step at once (one large GEMM outside the loop, exact because the input
  quantizer is elementwise with a fixed amax), ``h_q`` the quantized marker, ``w_hh`` / ``w_hr`` the quantized
  recurrent / projection weights (their Q/DQ is moved into the body, where onnxruntime fuses it).

A ``QuantLSTM`` with ``runtime_dynamic`` activations emits ``lq_export::dynamic_lstm(x, h0, c0, w_ih, w_hh,
b_ih, b_hh, reverse, hidden_size)`` per layer and direction instead: the whole layer as onnxruntime's fused
``DynamicQuantizeLSTM`` (:mod:`lq.export._dynamic_lstm` writes it once the weights are integer constants).

The ops exist for tracing only (fake implementations give the shapes; ``lstm_scan`` refuses to run
eagerly: ``h_q`` tells how ``h`` is quantized, not its values). :func:`translations` writes them as
placeholder nodes of the ``lq.export`` domain, which :mod:`lq.export._loops` turns into ``Scan``.
:func:`loop_mode` switches the ``QuantLSTM`` modules of the model being exported to this path where their
numerics allow it, and says which ones stay unrolled and why.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor

from lq.export._symbolic import DOMAIN, VERSION, register_placeholder

__all__ = ["loop_state", "lstm_scan", "dynamic_lstm", "loop_mode", "translations"]

LOOP_STATE = "LoopState"
LSTM_SCAN = "LSTMScan"
DYNAMIC_LSTM = "DynamicLSTM"


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
    """``(outputs (T, B, P), h_T (B, P), c_T (B, H))`` of one LSTM layer and direction; export placeholder only."""
    raise RuntimeError("lq_export::lstm_scan marks a QuantLSTM layer for lq.export.export_onnx and does not run; "
                       "call the QuantLSTM module itself")


def _layer_outputs(x, h0, c0):
    """Shapes of a recurrent placeholder's outputs: ``(T, B, H)`` from ``x``'s ``(T, B)``, and the final state."""
    return x.new_empty(x.shape[0], x.shape[1], h0.shape[-1]), torch.empty_like(h0), torch.empty_like(c0)


@lstm_scan.register_fake
def _(xw, h0, c0, h_q, w_hh, b_hh, w_hr, reverse, hidden_size):
    return _layer_outputs(xw, h0, c0)


@torch.library.custom_op("lq_export::dynamic_lstm", mutates_args=())
def dynamic_lstm(x: Tensor, h0: Tensor, c0: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Optional[Tensor],
                 b_hh: Optional[Tensor], reverse: bool, hidden_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(outputs (T, B, H), h_T (B, H), c_T (B, H))`` of one layer and direction run as onnxruntime's
    ``DynamicQuantizeLSTM``; export placeholder only (``w_ih``/``w_hh``: the quantized weights)."""
    raise RuntimeError("lq_export::dynamic_lstm marks a QuantLSTM layer for lq.export.export_onnx and does not run; "
                       "call the QuantLSTM module itself")


@dynamic_lstm.register_fake
def _(x, h0, c0, w_ih, w_hh, b_ih, b_hh, reverse, hidden_size):
    return _layer_outputs(x, h0, c0)


@contextlib.contextmanager
def loop_mode(model: torch.nn.Module) -> Iterator[list[str]]:
    """Within the block, every ``QuantLSTM`` of ``model`` whose numerics a loop reproduces traces as
    :func:`lstm_scan`; yields a note for each one that stays unrolled. Meant for the export's own copy
    of the model (it sets an instance attribute, removed again on exit)."""
    from lq.nn.modules.quant_rnn import QuantLSTM

    notes: list[str] = []
    switched = []
    for name, m in model.named_modules():
        if not isinstance(m, QuantLSTM):
            continue
        why = m._loop_export_blocker()
        if why:
            notes.append(unrolled_note(name, why))
        else:
            m._export_as_loop = True
            switched.append(m)
    try:
        yield notes
    finally:
        for m in switched:
            del m._export_as_loop


def unrolled_note(name: str, why: str) -> str:
    return (f"QuantLSTM '{name}' is exported unrolled (one copy of its step per time step, fixed sequence length): "
            f"{why}")


def legacy_notes(model: torch.nn.Module) -> list[str]:
    """The notes of :func:`loop_mode` for the legacy exporter, which writes every ``QuantLSTM`` unrolled."""
    from lq.nn.modules.quant_rnn import QuantLSTM

    return [unrolled_note(name, "the legacy exporter (dynamo=False) has no loop form; the current one has")
            for name, m in model.named_modules() if isinstance(m, QuantLSTM)]


def runtime_dynamic_layers(model: torch.nn.Module) -> list[str]:
    """Names of the ``QuantLSTM`` modules of ``model`` that quantize as onnxruntime's DynamicQuantizeLSTM."""
    from lq.nn.modules.quant_rnn import QuantLSTM

    return [f"'{name}'" for name, m in model.named_modules() if isinstance(m, QuantLSTM) and m.runtime_dynamic]


def register_schemas() -> None:
    """The onnx schemas of the two placeholders (idempotent)."""
    doc = "lq placeholder ({}); written as an ONNX Scan by lq.export"
    register_placeholder(LOOP_STATE, ["h"], ["y"], [], doc=doc.format(LOOP_STATE))
    register_placeholder(LSTM_SCAN, ["xw", "h0", "c0", "h_q", "w_hh"], ["y", "h_n", "c_n"], ["reverse", "hidden_size"],
                         optional=["b_hh", "w_hr"], doc=doc.format(LSTM_SCAN))
    register_placeholder(DYNAMIC_LSTM, ["x", "h0", "c0", "w_ih", "w_hh"], ["y", "h_n", "c_n"],
                         ["reverse", "hidden_size"], optional=["b_ih", "b_hh"],
                         doc="lq placeholder (DynamicLSTM); written as onnxruntime's DynamicQuantizeLSTM by lq.export")


def translations() -> dict:
    """Entries of the ``custom_translation_table`` (current exporter) for the two ops."""
    register_schemas()
    import onnxscript

    lqop = onnxscript.values.Opset(DOMAIN, VERSION)

    def loop_state_onnx(h):
        return lqop.LoopState(h)

    def lstm_scan_onnx(xw, h0, c0, h_q, w_hh, b_hh=None, w_hr=None, reverse: bool = False, hidden_size: int = 0):
        return lqop.LSTMScan(xw, h0, c0, h_q, w_hh, b_hh, w_hr, reverse=int(bool(reverse)),
                             hidden_size=int(hidden_size), _num_outputs=3)

    def dynamic_lstm_onnx(x, h0, c0, w_ih, w_hh, b_ih=None, b_hh=None, reverse: bool = False, hidden_size: int = 0):
        return lqop.DynamicLSTM(x, h0, c0, w_ih, w_hh, b_ih, b_hh, reverse=int(bool(reverse)),
                                hidden_size=int(hidden_size), _num_outputs=3)

    return {torch.ops.lq_export.loop_state.default: loop_state_onnx,
            torch.ops.lq_export.lstm_scan.default: lstm_scan_onnx,
            torch.ops.lq_export.dynamic_lstm.default: dynamic_lstm_onnx}
