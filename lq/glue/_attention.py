"""``F.scaled_dot_product_attention`` with its two matmuls quantized (what a glue site of kind ``attention``
calls instead of the fused op).

The fused op gives no place for a quantizer: the attention probabilities never leave it. Written out,
``softmax(q k^T * scale + mask) v`` has both matmuls on quantized operands (q and k; probabilities and v),
which the runtimes run as integer matmuls, and calibration and QAT see the same arithmetic. The
arithmetic is PyTorch's documented definition of the op; only masks and causal flags given as Python
values are handled here (a site with anything else is left alone by the glue rules).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def quantized_sdpa(query, key, value, q_query, q_key, q_probs, q_value, attn_mask=None, dropout_p=0.0,
                   is_causal=False, scale=None):
    """``scaled_dot_product_attention(query, key, value, ...)`` with quantizers on both matmuls' operands."""
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = torch.matmul(q_query(query), q_key(key).transpose(-2, -1)) * scale
    if is_causal:
        L, S = query.size(-2), key.size(-2)
        keep = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:  # as the fused op: its dropout does not look at the module's training flag
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(q_probs(probs), q_value(value))
