"""Quantized LSTM and LSTMCell.

Every matmul input is fake-quantized: the layer input ``x_t``, the hidden
state ``h_{t-1}`` and the weights ``W_ih``, ``W_hh`` (and ``W_hr`` with
``proj_size``), each with its own quantizer, so the input and the hidden
state (whose ranges differ a lot: ``h`` lives in (-1, 1)) get their own amax.
The recurrence is computed step by step in PyTorch (one GEMM for the input
projection of the whole sequence, one per step for the hidden state); with
every quantizer disabled it matches ``torch.nn.LSTM``.

Quantizer names: ``QuantLSTMCell`` has ``_input_quantizer``,
``_hidden_quantizer``, ``_weight_quantizer`` (``W_ih``) and
``_weight_hh_quantizer``; ``QuantLSTM`` has ModuleLists with one quantizer per
layer and direction (index ``layer * num_directions + direction``):
``_input_quantizers``, ``_hidden_quantizers``, ``_weight_quantizers``,
``_weight_hh_quantizers`` (and ``_weight_hr_quantizers``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from lq import tensor_quant
from lq.nn.modules._utils import QuantMixin, _tensor_quantizer_cls, quant_class

__all__ = ["QuantLSTM", "QuantLSTMCell", "LSTM", "LSTMCell"]


def _lstm_gates(x_proj, h_q, w_hh, b_hh, c):
    gates = x_proj + F.linear(h_q, w_hh, b_hh)
    i, f, g, o = gates.chunk(4, -1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h_new = torch.sigmoid(o) * torch.tanh(c_new)
    return h_new, c_new


@quant_class
class QuantLSTMCell(nn.LSTMCell, QuantMixin):
    """``nn.LSTMCell`` with quantized input, hidden state and weights."""

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
    _quantizer_names = ("_input_quantizer", "_hidden_quantizer", "_weight_quantizer", "_weight_hh_quantizer")

    def _setup_quantizers(self, quant_desc_input, quant_desc_weight):
        TensorQuantizer = _tensor_quantizer_cls()
        self._input_quantizer = TensorQuantizer(quant_desc_input)
        self._hidden_quantizer = TensorQuantizer(quant_desc_input)
        self._weight_quantizer = TensorQuantizer(quant_desc_weight)
        self._weight_hh_quantizer = TensorQuantizer(quant_desc_weight)

    def weight_quantizer_pairs(self):
        yield self._weight_quantizer, self.weight_ih
        yield self._weight_hh_quantizer, self.weight_hh

    def forward(self, input, hx=None):
        if input.dim() not in (1, 2):
            raise ValueError(f"QuantLSTMCell: expected input to be 1D or 2D, got {input.dim()}D instead")
        batched = input.dim() == 2
        x = input if batched else input.unsqueeze(0)
        if hx is None:
            zeros = torch.zeros(x.size(0), self.hidden_size, dtype=x.dtype, device=x.device)
            h, c = zeros, zeros
        else:
            h, c = hx
            if not batched:
                h, c = h.unsqueeze(0), c.unsqueeze(0)
        x_proj = F.linear(self._input_quantizer(x), self._weight_quantizer(self.weight_ih), self.bias_ih)
        w_hh = self._weight_hh_quantizer(self.weight_hh)
        h, c = _lstm_gates(x_proj, self._hidden_quantizer(h), w_hh, self.bias_hh, c)
        if not batched:
            h, c = h.squeeze(0), c.squeeze(0)
        return h, c


@quant_class
class QuantLSTM(nn.LSTM, QuantMixin):
    """``nn.LSTM`` (layers, bidirectional, batch_first, dropout, proj_size, PackedSequence)
    with quantized layer inputs, hidden states and weights."""

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
    _quantizer_names = (
        "_input_quantizers",
        "_hidden_quantizers",
        "_weight_quantizers",
        "_weight_hh_quantizers",
        "_weight_hr_quantizers",
    )

    @property
    def _num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    def _setup_quantizers(self, quant_desc_input, quant_desc_weight):
        TensorQuantizer = _tensor_quantizer_cls()
        n = self.num_layers * self._num_directions

        def make(desc):
            return nn.ModuleList(TensorQuantizer(desc) for _ in range(n))

        self._input_quantizers = make(quant_desc_input)
        self._hidden_quantizers = make(quant_desc_input)
        self._weight_quantizers = make(quant_desc_weight)
        self._weight_hh_quantizers = make(quant_desc_weight)
        if self.proj_size > 0:
            self._weight_hr_quantizers = make(quant_desc_weight)

    @property
    def input_quantizer(self):
        raise AttributeError("QuantLSTM has one quantizer per layer and direction: use _input_quantizers[i]")

    @property
    def weight_quantizer(self):
        raise AttributeError("QuantLSTM has one quantizer per layer and direction: use _weight_quantizers[i]")

    def _layer_weights(self, layer: int, direction: int):
        sfx = f"_l{layer}" + ("_reverse" if direction else "")
        w_ih = getattr(self, "weight_ih" + sfx)
        w_hh = getattr(self, "weight_hh" + sfx)
        b_ih = getattr(self, "bias_ih" + sfx) if self.bias else None
        b_hh = getattr(self, "bias_hh" + sfx) if self.bias else None
        w_hr = getattr(self, "weight_hr" + sfx) if self.proj_size > 0 else None
        return w_ih, w_hh, b_ih, b_hh, w_hr

    def weight_quantizer_pairs(self):
        for layer in range(self.num_layers):
            for d in range(self._num_directions):
                idx = layer * self._num_directions + d
                w_ih, w_hh, _, _, w_hr = self._layer_weights(layer, d)
                yield self._weight_quantizers[idx], w_ih
                yield self._weight_hh_quantizers[idx], w_hh
                if w_hr is not None:
                    yield self._weight_hr_quantizers[idx], w_hr

    def _run_direction(self, x, h, c, layer, direction, mask):
        idx = layer * self._num_directions + direction
        w_ih, w_hh, b_ih, b_hh, w_hr = self._layer_weights(layer, direction)
        x_proj = F.linear(self._input_quantizers[idx](x), self._weight_quantizers[idx](w_ih), b_ih)
        w_hh = self._weight_hh_quantizers[idx](w_hh)
        if w_hr is not None:
            w_hr = self._weight_hr_quantizers[idx](w_hr)
        h_quant = self._hidden_quantizers[idx]
        steps = range(x.size(0) - 1, -1, -1) if direction else range(x.size(0))
        outs = [None] * x.size(0)
        for t in steps:
            h_new, c_new = _lstm_gates(x_proj[t], h_quant(h), w_hh, b_hh, c)
            if w_hr is not None:
                h_new = F.linear(h_new, w_hr)
            if mask is None:
                h, c = h_new, c_new
                outs[t] = h_new
            else:
                m = mask[t].unsqueeze(1)
                h = torch.where(m, h_new, h)
                c = torch.where(m, c_new, c)
                outs[t] = torch.where(m, h_new, torch.zeros_like(h_new))
        return torch.stack(outs), h, c

    def forward(self, input, hx=None):
        packed = isinstance(input, PackedSequence)
        if packed:
            x, lengths = pad_packed_sequence(input)  # (T, B, F), original batch order
            batched = True
        else:
            if input.dim() not in (2, 3):
                raise ValueError(f"QuantLSTM: expected input to be 2D or 3D, got {input.dim()}D instead")
            batched = input.dim() == 3
            x = input if batched else input.unsqueeze(1)
            if self.batch_first and batched:
                x = x.transpose(0, 1)
            lengths = None
        if x.size(-1) != self.input_size:
            raise RuntimeError(
                f"input.size(-1) must be equal to input_size. Expected {self.input_size}, got {x.size(-1)}"
            )
        T, B = x.shape[:2]
        n = self.num_layers * self._num_directions
        h_size = self.proj_size if self.proj_size > 0 else self.hidden_size
        if hx is None:
            h0 = torch.zeros(n, B, h_size, dtype=x.dtype, device=x.device)
            c0 = torch.zeros(n, B, self.hidden_size, dtype=x.dtype, device=x.device)
        else:
            h0, c0 = hx
            if not batched:
                if h0.dim() != 2 or c0.dim() != 2:
                    raise RuntimeError("For unbatched 2-D input, hx and cx should also be 2-D")
                h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
            if tuple(h0.shape) != (n, B, h_size):
                raise RuntimeError(f"Expected hidden[0] size {(n, B, h_size)}, got {tuple(h0.shape)}")
            if tuple(c0.shape) != (n, B, self.hidden_size):
                raise RuntimeError(f"Expected hidden[1] size {(n, B, self.hidden_size)}, got {tuple(c0.shape)}")
        mask = None
        if lengths is not None:
            mask = torch.arange(T).unsqueeze(1) < lengths.unsqueeze(0)
            mask = mask.to(x.device)
        layer_in, h_n, c_n = x, [], []
        for layer in range(self.num_layers):
            outs = []
            for d in range(self._num_directions):
                idx = layer * self._num_directions + d
                out, h, c = self._run_direction(layer_in, h0[idx], c0[idx], layer, d, mask)
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
            layer_in = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
            if self.dropout and self.training and layer < self.num_layers - 1:
                layer_in = F.dropout(layer_in, p=self.dropout, training=True)
        out, h_n, c_n = layer_in, torch.stack(h_n), torch.stack(c_n)
        if packed:
            if input.sorted_indices is not None:
                out = out.index_select(1, input.sorted_indices)
            data = torch.cat([out[t, :bs] for t, bs in enumerate(input.batch_sizes.tolist())])
            return PackedSequence(data, input.batch_sizes, input.sorted_indices, input.unsorted_indices), (h_n, c_n)
        if not batched:
            return out.squeeze(1), (h_n.squeeze(1), c_n.squeeze(1))
        if self.batch_first:
            out = out.transpose(0, 1)
        return out, (h_n, c_n)


LSTM = QuantLSTM
LSTMCell = QuantLSTMCell
