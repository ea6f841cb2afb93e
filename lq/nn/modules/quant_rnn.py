"""Quantized LSTM and LSTMCell, computing what pytorch-quantization's ``QuantLSTM`` defines.

Why this layout: at inference, one LSTM step of one layer and direction is a
single GEMM of the step input and the previous hidden state side by side,
``[x_t | h_{t-1}]``, with the gate weights side by side, ``[W_ih | W_hh]``. So
each is quantized as ONE tensor:

* one input quantizer sees ``cat([x_t, h_{t-1}], dim=1)`` at every step (one amax
  for both: uncalibrated, it is max |.| of that step's pair);
* one weight quantizer sees ``cat([W_ih, W_hh], dim=1)`` (per row by default: a row
  holds one gate unit's weights over the input and the hidden state);
* biases and the cell state stay float; gates are in torch's order (i, f, g, o)
  and each step is ``linear(x, W_ih, b_ih) + linear(h, W_hh, b_hh)``.

A calibrated quantizer (static amax, per tensor or per row) gives the parts of such a
tensor the same numbers on their own, and then quantizes them one by one: the exported
graph gets a Q/DQ right at every matmul (see :func:`quantize_side_by_side`).

``QuantLSTMCell`` has ``_input_quantizer`` / ``_weight_quantizer``; ``QuantLSTM`` has
the ModuleLists ``_input_quantizers`` / ``_weight_quantizers`` with one entry per
layer and direction (index ``layer * num_directions + direction``). Beyond the
reference toolkit, ``QuantLSTM`` takes ``proj_size`` (``W_hr`` gets its own weight
quantizer, ``_weight_hr_quantizers``), PackedSequence input (each step quantizes
the rows of the sequences still running), unbatched input and ``from_float``.
With every quantizer disabled both equal ``torch.nn.LSTM`` / ``LSTMCell``.

Export: inside ``lq.export.export_onnx`` a ``QuantLSTM`` whose input quantizers are calibrated per
tensor traces each layer and direction as one placeholder op (:meth:`QuantLSTM._direction_loop`) that
the export writes as an ONNX ``Scan``: one loop, any sequence length, the step's Q/DQ inside it.

``QuantLSTM.set_runtime_dynamic()`` (``recurrent="dynamic"`` in :class:`lq.config.QuantConfig`) computes
instead what onnxruntime's fused ``DynamicQuantizeLSTM`` runs: no input quantizers, each layer's input and
every step's ``h`` quantized to uint8 from themselves (:mod:`lq.nn.modules._runtime_dynamic`), the weights as
calibrated; exported as that one op per layer and direction (:mod:`lq.export.passes._dynamic_lstm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from lq import tensor_quant
from lq.nn.modules import _rnn_markers
from lq.nn.modules._runtime_dynamic import runtime_dynamic_fake_quant
from lq.nn.modules._utils import QuantMixin, _tensor_quantizer_cls, quant_class

__all__ = ["QuantLSTM", "QuantLSTMCell", "LSTM", "LSTMCell"]


def _parts_quantize_alike(quantizer, ndim: int) -> bool:
    """True when ``quantizer`` gives each part of a tensor split along dim 1 the numbers it gives
    that part inside the whole: it is disabled, or it maps every element on its own with one fixed
    amax along dim 1 (static, per tensor or per row), no blocks, and it is not collecting
    calibration data (a calibrator must see the whole, e.g. an EMA of its amax)."""
    if not quantizer.is_enabled:
        return True
    if quantizer._if_calib or quantizer.dynamic or quantizer.block_sizes is not None or quantizer.is_affine:
        return False
    amax = quantizer.amax
    return amax is not None and (amax.numel() == 1 or (amax.dim() == ndim and amax.size(1) == 1))


def quantize_side_by_side(quantizer, parts):
    """``quantizer(torch.cat(parts, 1))`` split back into ``parts``.

    Where that gives the same numbers (:func:`_parts_quantize_alike`: a calibrated quantizer)
    each part is quantized on its own instead, so an exported graph has every part's Q/DQ right
    at the matmul that reads it: onnxruntime fuses Q/DQ into an integer GEMM only there.
    """
    if _parts_quantize_alike(quantizer, parts[0].dim()):
        return [quantizer(p) for p in parts]
    return quantizer(torch.cat(parts, 1)).split([p.size(1) for p in parts], 1)


def lstm_step(x, h, c, w_ih, w_hh, b_ih, b_hh, input_quantizer):
    """One LSTM step on 2-D ``x``/``h``/``c``; ``w_ih``/``w_hh`` are already quantized.
    ``[x | h]`` is quantized as one tensor by ``input_quantizer``. Returns ``(h', c')``."""
    x, h = quantize_side_by_side(input_quantizer, [x, h])
    return _cell(F.linear(x, w_ih, b_ih) + F.linear(h, w_hh, b_hh), c)


def _cell(gates, c):
    """``(h', c')`` from the gate pre-activations (torch's order i, f, g, o) and the cell state."""
    i, f, g, o = gates.chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def runtime_dynamic_step(x_q, h, c, w_ih, w_hh, b_ih, b_hh):
    """One step of :attr:`QuantLSTM.runtime_dynamic`: ``x_q`` is already quantized (with the whole sequence),
    ``h`` is quantized from itself; the sums in onnxruntime's order (both GEMMs, then the two biases)."""
    gates = F.linear(x_q, w_ih) + F.linear(runtime_dynamic_fake_quant(h), w_hh)
    if b_ih is not None:
        gates = gates + (b_ih + b_hh)
    return _cell(gates, c)


@quant_class
class QuantLSTMCell(nn.LSTMCell, QuantMixin):
    """``nn.LSTMCell`` with ``[input | hidden]`` and ``[W_ih | W_hh]`` each fake-quantized as one tensor."""

    traces_as_float = False  # its own cell arithmetic on the concatenated input, not nn.LSTMCell's op

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW

    def weight_quantizer_pairs(self):
        yield self._weight_quantizer, torch.cat([self.weight_ih, self.weight_hh], 1)

    def forward(self, input, hx=None):
        if input.dim() not in (1, 2):
            raise ValueError(f"QuantLSTMCell: expected input to be 1D or 2D, got {input.dim()}D instead")
        if input.size(-1) != self.input_size:
            raise RuntimeError(f"input has inconsistent input_size: got {input.size(-1)}, expected {self.input_size}")
        batched = input.dim() == 2
        x = input if batched else input.unsqueeze(0)
        if hx is None:
            h = c = torch.zeros(x.size(0), self.hidden_size, dtype=x.dtype, device=x.device)
        else:
            h, c = hx if batched else (hx[0].unsqueeze(0), hx[1].unsqueeze(0))
            for label, t in (("[0]", h), ("[1]", c)):
                if tuple(t.shape) != (x.size(0), self.hidden_size):
                    raise RuntimeError(
                        f"hidden{label} must be {(x.size(0), self.hidden_size)} for this input, got {tuple(t.shape)}"
                    )
        w_ih, w_hh = quantize_side_by_side(self._weight_quantizer, [self.weight_ih, self.weight_hh])
        h, c = lstm_step(x, h, c, w_ih, w_hh, self.bias_ih, self.bias_hh, self._input_quantizer)
        if not batched:
            h, c = h.squeeze(0), c.squeeze(0)
        return h, c


def _steps(seq, batch_sizes):
    """The per-step 2-D inputs of a layer: rows of a (T, B, F) tensor, or of packed data."""
    return seq.unbind(0) if batch_sizes is None else seq.split(batch_sizes)


def _join(outs, batch_sizes):
    """Inverse of :func:`_steps` for a direction's outputs."""
    return torch.stack(outs) if batch_sizes is None else torch.cat(outs)


@quant_class
class QuantLSTM(nn.LSTM, QuantMixin):
    """``nn.LSTM`` (layers, bidirectional, batch_first, dropout, proj_size, PackedSequence) with
    ``[x_t | h_{t-1}]`` and ``[W_ih | W_hh]`` fake-quantized as one tensor each, per layer and direction."""

    traces_as_float = False  # its own step loop, not nn.LSTM's one fused op

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
    _quantizer_names = ("_input_quantizers", "_weight_quantizers", "_weight_hr_quantizers")
    #: set by lq.export on the copy it exports (:func:`lq.export.trace._loop_ops.loop_mode`): trace the time loop as
    #: one placeholder op per layer and direction instead of one step per time step
    _export_as_loop = False
    #: activations quantized as onnxruntime's fused ``DynamicQuantizeLSTM`` does it (set with
    #: :meth:`set_runtime_dynamic`): each layer's input sequence and every step's ``h`` to uint8 with a scale
    #: and zero point taken from that tensor itself (:mod:`lq.nn.modules._runtime_dynamic`); the weights keep
    #: their (calibrated, per-row) quantizers, the input quantizers are not used. The mode IS this buffer
    #: (present only when on), so the state_dict carries it: loading a state dict sets the mode it was saved
    #: in, and a checkpoint reproduces its model's numbers either way
    _MODE_KEY = "_runtime_dynamic"

    @property
    def runtime_dynamic(self) -> bool:
        return self._MODE_KEY in self._buffers

    @property
    def _num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    def _setup_quantizers(self, quant_desc_input, quant_desc_weight):
        n = self.num_layers * self._num_directions
        self.init_quantizer(quant_desc_input, quant_desc_weight, num_layers=n)
        if self.proj_size > 0:
            TensorQuantizer = _tensor_quantizer_cls()
            self._weight_hr_quantizers = nn.ModuleList(TensorQuantizer(quant_desc_weight) for _ in range(n))

    def _layer_params(self, idx: int):
        """``(w_ih, w_hh, b_ih, b_hh, w_hr)`` of layer-direction ``idx`` (None where absent)."""
        layer, direction = divmod(idx, self._num_directions)
        sfx = f"_l{layer}" + ("_reverse" if direction else "")
        get = lambda name: getattr(self, name + sfx)  # noqa: E731
        return (
            get("weight_ih"),
            get("weight_hh"),
            get("bias_ih") if self.bias else None,
            get("bias_hh") if self.bias else None,
            get("weight_hr") if self.proj_size > 0 else None,
        )

    def weight_quantizer_pairs(self):
        for idx in range(self.num_layers * self._num_directions):
            w_ih, w_hh, _, _, w_hr = self._layer_params(idx)
            yield self._weight_quantizers[idx], torch.cat([w_ih, w_hh], 1)
            if w_hr is not None:
                yield self._weight_hr_quantizers[idx], w_hr

    def set_runtime_dynamic(self, on: bool = True) -> "QuantLSTM":
        """Quantize the activations as onnxruntime's ``DynamicQuantizeLSTM`` does (see :attr:`runtime_dynamic`),
        or back to the input quantizers (``on=False``). The input quantizers are disabled while it is on (they
        would see nothing to calibrate) and enabled again when it is switched off. onnxruntime only; not with
        ``proj_size`` (the op has no projection)."""
        if on and self.proj_size > 0:
            raise ValueError("QuantLSTM.set_runtime_dynamic: onnxruntime's DynamicQuantizeLSTM has no projection; "
                             f"proj_size={self.proj_size} is allowed only with the input quantizers (on=False)")
        if bool(on) == self.runtime_dynamic:
            return self
        for q in self._input_quantizers:
            q.disable() if on else q.enable()
        if on:
            self.register_buffer(self._MODE_KEY, torch.ones((), dtype=torch.bool, device=self.weight_ih_l0.device))
        else:
            del self._buffers[self._MODE_KEY]
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.set_runtime_dynamic(prefix + self._MODE_KEY in state_dict)  # the mode the state was saved in
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", runtime_dynamic=True" if self.runtime_dynamic else "")

    def _direction(self, steps, h, c, idx, reverse):
        """Run layer-direction ``idx`` over ``steps`` (2-D step inputs in time order, the batch
        shrinking for packed input: only the first rows are still running) from state ``h, c``.
        Returns the outputs in time order and the final ``h, c``. With :attr:`runtime_dynamic` the
        steps are already quantized (the layer's whole input at once)."""
        w_ih, w_hh, b_ih, b_hh, w_hr = self._layer_params(idx)
        w_ih, w_hh = quantize_side_by_side(self._weight_quantizers[idx], [w_ih, w_hh])
        if w_hr is not None:
            w_hr = self._weight_hr_quantizers[idx](w_hr)
        in_q = self._input_quantizers[idx]
        outs = [None] * len(steps)
        for t in reversed(range(len(steps))) if reverse else range(len(steps)):
            n = steps[t].size(0)
            if self.runtime_dynamic:  # padded input only (forward refuses a PackedSequence)
                h, c = runtime_dynamic_step(steps[t], h, c, w_ih, w_hh, b_ih, b_hh)
                outs[t] = h
                continue
            if n == h.size(0):
                h_new, c = lstm_step(steps[t], h, c, w_ih, w_hh, b_ih, b_hh, in_q)
            else:  # packed input: rows n.. are finished (forward) or not started (reverse)
                h_new, c_new = lstm_step(steps[t], h[:n], c[:n], w_ih, w_hh, b_ih, b_hh, in_q)
                c = torch.cat([c_new, c[n:]])
            if w_hr is not None:
                h_new = F.linear(h_new, w_hr)
            h = h_new if n == h.size(0) else torch.cat([h_new, h[n:]])
            outs[t] = h_new
        return outs, h, c

    def _loop_export_blocker(self) -> str | None:
        """Why :meth:`_direction_loop` would not compute what :meth:`_direction` does (None: it would).

        The loop quantizes ``x`` of every step at once and ``h`` inside the step, each with the layer's input
        quantizer: the numbers of the fused ``[x_t | h_{t-1}]`` only when that quantizer maps every element on
        its own with one fixed amax (calibrated, per tensor) or is disabled."""
        for i, q in enumerate(self._input_quantizers):
            if q.is_enabled and not (_parts_quantize_alike(q, 2) and q.amax.numel() == 1):
                return (f"_input_quantizers.{i} is not a calibrated per-tensor quantizer (dynamic, per-row or "
                        "collecting calibration data), so it quantizes [x_t | h_t-1] as one tensor per step")
        return None

    def _direction_loop(self, seq, h, c, idx, reverse):
        """Export path of :meth:`_direction` over a whole ``(T, B, F)`` sequence: one ``lq_export::lstm_scan``
        marker (:mod:`lq.nn.modules._rnn_markers`; written as an ONNX ``Scan`` by lq.export). ``x`` of all steps is quantized and projected
        at once; the quantizer of ``h`` is traced on a ``loop_state`` marker so the export moves exactly those
        nodes into the loop body. Returns the outputs ``(T, B, P)`` and the final ``h, c``."""
        w_ih, w_hh, b_ih, b_hh, w_hr = self._layer_params(idx)
        w_ih, w_hh = quantize_side_by_side(self._weight_quantizers[idx], [w_ih, w_hh])
        if w_hr is not None:
            w_hr = self._weight_hr_quantizers[idx](w_hr)
        if self.runtime_dynamic:  # the whole layer as onnxruntime's DynamicQuantizeLSTM
            return _rnn_markers.dynamic_lstm(seq, h, c, w_ih, w_hh, b_ih, b_hh, reverse, self.hidden_size)
        in_q = self._input_quantizers[idx]
        xw = F.linear(in_q(seq), w_ih, b_ih)
        h_q = in_q(_rnn_markers.loop_state(h))
        return _rnn_markers.lstm_scan(xw, h, c, h_q, w_hh, b_hh, w_hr, reverse, self.hidden_size)

    def _initial_state(self, hx, batch, batched, like):
        n = self.num_layers * self._num_directions
        h_size = self.proj_size if self.proj_size > 0 else self.hidden_size
        if hx is None:
            h0 = torch.zeros(n, batch, h_size, dtype=like.dtype, device=like.device)
            return h0, torch.zeros(n, batch, self.hidden_size, dtype=like.dtype, device=like.device)
        h0, c0 = hx
        if not batched:
            if h0.dim() != 2 or c0.dim() != 2:
                raise RuntimeError("For unbatched 2-D input, hx and cx should also be 2-D")
            h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
        if tuple(h0.shape) != (n, batch, h_size):
            raise RuntimeError(f"Expected hidden[0] size {(n, batch, h_size)}, got {tuple(h0.shape)}")
        if tuple(c0.shape) != (n, batch, self.hidden_size):
            raise RuntimeError(f"Expected hidden[1] size {(n, batch, self.hidden_size)}, got {tuple(c0.shape)}")
        return h0, c0

    def forward(self, input, hx=None):
        packed = isinstance(input, PackedSequence)
        layout = "(B, T, F)" if self.batch_first else "(T, B, F)"
        if packed and self.runtime_dynamic:
            raise ValueError(f"QuantLSTM with runtime_dynamic activations takes the padded {layout} tensor, not a "
                             "PackedSequence: onnxruntime's fused LSTM quantizes the whole padded sequence at once "
                             "(set_runtime_dynamic(False), recurrent='scan', runs a PackedSequence in PyTorch)")
        if packed and self._export_as_loop:
            raise ValueError("QuantLSTM: a PackedSequence input cannot be exported (its batch sizes are data); "
                             f"export with the padded {layout} tensor instead")
        if packed:
            seq, batch_sizes = input.data, input.batch_sizes.tolist()
            batched, batch = True, batch_sizes[0]
        else:
            if input.dim() not in (2, 3):
                raise ValueError(f"QuantLSTM: expected input to be 2D or 3D, got {input.dim()}D instead")
            batched, batch_sizes = input.dim() == 3, None
            seq = input if batched else input.unsqueeze(1)
            if self.batch_first and batched:
                seq = seq.transpose(0, 1)
            batch = seq.size(1)
        if seq.size(-1) != self.input_size:
            raise RuntimeError(
                f"input.size(-1) must be equal to input_size. Expected {self.input_size}, got {seq.size(-1)}"
            )
        h0, c0 = self._initial_state(hx, batch, batched, seq)
        if packed and input.sorted_indices is not None:  # the state follows the length-sorted batch
            h0, c0 = h0.index_select(1, input.sorted_indices), c0.index_select(1, input.sorted_indices)
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            if self.runtime_dynamic and not self._export_as_loop:  # the layer's input, all steps at once
                steps = _steps(runtime_dynamic_fake_quant(seq), None)
            else:
                steps = None if self._export_as_loop else _steps(seq, batch_sizes)
            outs = []
            for d in range(self._num_directions):
                idx = layer * self._num_directions + d
                if steps is None:
                    out, h, c = self._direction_loop(seq, h0[idx], c0[idx], idx, reverse=d == 1)
                else:
                    out, h, c = self._direction(steps, h0[idx], c0[idx], idx, reverse=d == 1)
                    out = _join(out, batch_sizes)
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
            seq = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
            if self.dropout and layer < self.num_layers - 1:
                seq = F.dropout(seq, p=self.dropout, training=self.training)
        h_n, c_n = torch.stack(h_n), torch.stack(c_n)
        if packed:
            if input.unsorted_indices is not None:
                h_n, c_n = h_n.index_select(1, input.unsorted_indices), c_n.index_select(1, input.unsorted_indices)
            out = PackedSequence(seq, input.batch_sizes, input.sorted_indices, input.unsorted_indices)
            return out, (h_n, c_n)
        if not batched:
            return seq.squeeze(1), (h_n.squeeze(1), c_n.squeeze(1))
        return (seq.transpose(0, 1) if self.batch_first else seq), (h_n, c_n)


LSTM = QuantLSTM
LSTMCell = QuantLSTMCell
