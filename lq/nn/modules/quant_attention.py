"""Quantized multi-head attention.

``QuantMultiheadAttention`` is an ``nn.MultiheadAttention`` (same parameters,
same state_dict keys, same forward arguments: ``key_padding_mask``,
``need_weights``, ``attn_mask``, ``average_attn_weights``, ``is_causal``, with
``batch_first`` and unbatched inputs) whose every matmul input is quantized:

* ``_input_quantizer``: query, key and value entering the input projection
  (one amax: in self-attention they are one tensor, quantized once);
* ``_in_proj_weight_quantizer``: ``in_proj_weight`` (or ``q/k/v_proj_weight``);
* ``_matmul_q_input_quantizer`` / ``_matmul_k_input_quantizer``: Q and K of ``Q @ K^T``;
* ``_matmul_a_input_quantizer`` / ``_matmul_v_input_quantizer``: the attention
  probabilities (after dropout) and V of ``attn @ V``;
* ``out_proj`` is a :class:`~lq.nn.QuantLinear` (``out_proj._input_quantizer``,
  ``out_proj._weight_quantizer``), holding the same ``out_proj.weight``/``bias``.

The names of the four matmul quantizers follow NVIDIA's quantized BERT, so
code that calibrates every ``*_input_quantizer`` finds them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lq import tensor_quant
from lq.nn.modules._utils import QuantMixin, _disable_mha_fastpath_hook, _tensor_quantizer_cls, quant_class
from lq.nn.modules.quant_linear import QuantLinear

__all__ = ["QuantMultiheadAttention", "MultiheadAttention"]

_FloatMHA = nn.MultiheadAttention
try:
    from torch.nn.modules.linear import NonDynamicallyQuantizableLinear as _OutProjLinear
except ImportError:  # pragma: no cover - older/newer torch
    _OutProjLinear = nn.Linear


def _additive_mask(mask, name, dtype):
    """Bool masks (True = masked out) become 0 / -inf float masks; float masks are added as is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError(f"only bool and floating types of {name} are supported, got {mask.dtype}")
    return mask.to(dtype)


@quant_class
class QuantMultiheadAttention(nn.MultiheadAttention, QuantMixin):
    """``nn.MultiheadAttention`` with quantized projections and quantized inputs of both matmuls."""

    traces_as_float = False  # its own attention code, not nn.MultiheadAttention's

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
    _quantizer_names = (
        "_input_quantizer",
        "_in_proj_weight_quantizer",
        "_matmul_q_input_quantizer",
        "_matmul_k_input_quantizer",
        "_matmul_v_input_quantizer",
        "_matmul_a_input_quantizer",
    )

    def _from_float_children(self, quant_desc_input, quant_desc_weight):
        if not isinstance(self.out_proj, QuantLinear):
            self.out_proj = QuantLinear.from_float(self.out_proj, quant_desc_input, quant_desc_weight)

    def _setup_quantizers(self, quant_desc_input, quant_desc_weight):
        TensorQuantizer = _tensor_quantizer_cls()
        self._input_quantizer = TensorQuantizer(quant_desc_input)
        self._in_proj_weight_quantizer = TensorQuantizer(quant_desc_weight)
        self._matmul_q_input_quantizer = TensorQuantizer(quant_desc_input)
        self._matmul_k_input_quantizer = TensorQuantizer(quant_desc_input)
        self._matmul_v_input_quantizer = TensorQuantizer(quant_desc_input)
        self._matmul_a_input_quantizer = TensorQuantizer(quant_desc_input)
        # nn.TransformerEncoderLayer's fused inference kernel reads in_proj_weight directly and
        # would bypass every quantizer here; it is skipped when a submodule has a forward hook.
        if _disable_mha_fastpath_hook not in self._forward_pre_hooks.values():
            self.register_forward_pre_hook(_disable_mha_fastpath_hook)

    def _to_float_children(self, new):
        out = new._modules.get("out_proj")
        if isinstance(out, QuantLinear):
            out = out.to_float()
            if type(out) is nn.Linear and _OutProjLinear is not nn.Linear:
                fresh = _OutProjLinear.__new__(_OutProjLinear)
                fresh.__dict__.update(out.__dict__)
                out = fresh
            new._modules["out_proj"] = out
        hooks = new._forward_pre_hooks
        for k in [k for k, v in hooks.items() if v is _disable_mha_fastpath_hook]:
            del hooks[k]

    @property
    def weight_quantizer(self):
        return self._in_proj_weight_quantizer

    def weight_quantizer_pairs(self):
        if self._qkv_same_embed_dim:
            yield self._in_proj_weight_quantizer, self.in_proj_weight
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                yield self._in_proj_weight_quantizer, w
        yield from self.out_proj.weight_quantizer_pairs()

    def _in_proj_weights(self):
        wq = self._in_proj_weight_quantizer
        if self._qkv_same_embed_dim:
            return wq(self.in_proj_weight).chunk(3)
        return wq(self.q_proj_weight), wq(self.k_proj_weight), wq(self.v_proj_weight)

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        if query.dim() not in (2, 3):
            raise AssertionError(f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D")
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise AssertionError(
                f"query, key and value must have the same number of dims, got {query.dim()}, {key.dim()}, {value.dim()}"
            )
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                "method `generate_square_subsequent_mask` to create this mask."
            )
        # like torch: with no key padding mask and no weights requested, is_causal means a causal
        # mask over the final key length (bias_k / zero attention included) instead of attn_mask
        causal_only = is_causal and key_padding_mask is None and not need_weights
        if causal_only:
            attn_mask = None
        key_is_query, value_is_key = key is query, value is key
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        # now (N, L, E) / (N, S, E_k) / (N, S, E_v)
        N, L, E = query.shape
        S = key.shape[1]
        H, Dh = self.num_heads, self.head_dim
        if E != self.embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but got {E}")
        if key.shape[:2] != value.shape[:2]:
            raise AssertionError(
                f"key's sequence and batch dims {key.shape[:2]} do not match value's {value.shape[:2]}"
            )

        # input projections on quantized inputs and weights
        qin = self._input_quantizer
        q_in = qin(query)
        k_in = q_in if key_is_query else qin(key)
        v_in = k_in if value_is_key else qin(value)
        w_q, w_k, w_v = self._in_proj_weights()
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q = F.linear(q_in, w_q, b_q)
        k = F.linear(k_in, w_k, b_k)
        v = F.linear(v_in, w_v, b_v)

        # masks as additive float masks
        kpm = _additive_mask(key_padding_mask, "key_padding_mask", q.dtype)
        am = _additive_mask(attn_mask, "attn_mask", q.dtype)
        if am is not None:
            if am.dim() == 2:
                if tuple(am.shape) != (L, S):
                    raise RuntimeError(f"The shape of the 2D attn_mask is {tuple(am.shape)}, but should be {(L, S)}.")
                am = am.unsqueeze(0)
            elif am.dim() == 3:
                if tuple(am.shape) != (N * H, L, S):
                    raise RuntimeError(
                        f"The shape of the 3D attn_mask is {tuple(am.shape)}, but should be {(N * H, L, S)}."
                    )
            else:
                raise RuntimeError(f"attn_mask's dimension {am.dim()} is not supported")
        if kpm is not None and tuple(kpm.shape) != (N, S):
            raise AssertionError(f"expecting key_padding_mask shape of {(N, S)}, but got {tuple(kpm.shape)}")

        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.reshape(1, 1, E).expand(N, 1, E)], dim=1)
            v = torch.cat([v, self.bias_v.reshape(1, 1, E).expand(N, 1, E)], dim=1)
            am = F.pad(am, (0, 1)) if am is not None else None
            kpm = F.pad(kpm, (0, 1)) if kpm is not None else None

        q = q.reshape(N, L, H, Dh).transpose(1, 2)  # (N, H, L, Dh)
        k = k.reshape(N, k.shape[1], H, Dh).transpose(1, 2)
        v = v.reshape(N, v.shape[1], H, Dh).transpose(1, 2)
        if self.add_zero_attn:
            zeros = torch.zeros((N, H, 1, Dh), dtype=k.dtype, device=k.device)
            k = torch.cat([k, zeros], dim=2)
            v = torch.cat([v, zeros], dim=2)
            am = F.pad(am, (0, 1)) if am is not None else None
            kpm = F.pad(kpm, (0, 1)) if kpm is not None else None
        S_full = k.shape[2]
        if causal_only:
            am = torch.zeros((L, S_full), dtype=q.dtype, device=q.device).masked_fill_(
                torch.ones((L, S_full), dtype=torch.bool, device=q.device).triu(1), float("-inf")
            ).unsqueeze(0)

        # attention: both matmuls see quantized inputs
        scores = torch.matmul(self._matmul_q_input_quantizer(q), self._matmul_k_input_quantizer(k).transpose(-2, -1))
        scores = scores * (1.0 / math.sqrt(Dh))
        if am is not None:
            scores = scores + (am.unsqueeze(0) if am.shape[0] == 1 else am.reshape(N, H, L, S_full))
        if kpm is not None:
            scores = scores + kpm.reshape(N, 1, 1, S_full)
        attn = torch.softmax(scores, dim=-1)
        if self.training and self.dropout > 0.0:
            attn = F.dropout(attn, p=self.dropout, training=True)
        attn = self._matmul_a_input_quantizer(attn)
        out = torch.matmul(attn, self._matmul_v_input_quantizer(v))  # (N, H, L, Dh)
        out = self.out_proj(out.transpose(1, 2).reshape(N, L, E))

        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        weights = attn.mean(dim=1) if average_attn_weights else attn
        if not batched:
            weights = weights.squeeze(0)
        return out, weights


MultiheadAttention = QuantMultiheadAttention
