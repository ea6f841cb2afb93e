"""The exporter's side of a recurrent layer written as one ONNX ``Scan`` (or one fused LSTM), not unrolled.

A ``QuantLSTM`` traces as the markers of :mod:`lq.nn.modules._rnn_markers` (``loop_state``, ``lstm_scan``,
``dynamic_lstm``) when :func:`loop_mode` switches it to that path, where its numerics allow it (and says which
layers stay unrolled and why). :func:`translations` writes the markers as placeholder nodes of the
``lq.export`` domain, which :mod:`lq.export.passes._loops` turns into ``Scan`` and :mod:`lq.export.passes._dynamic_lstm`
into onnxruntime's ``DynamicQuantizeLSTM``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from lq.export.trace._symbolic import DOMAIN, VERSION, register_placeholder
from lq.nn.modules._rnn_markers import dynamic_lstm, loop_state, lstm_scan  # noqa: F401  (the ops this writes)

__all__ = ["loop_state", "lstm_scan", "dynamic_lstm", "loop_mode", "translations"]

LOOP_STATE = "LoopState"
LSTM_SCAN = "LSTMScan"
DYNAMIC_LSTM = "DynamicLSTM"


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
