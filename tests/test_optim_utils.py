"""lq.optim.helper (parameter groups by name, in-place weight quantization) and lq.utils.reduce_amax."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

import lq
from lq.nn import QuantConv2d, QuantLinear, QuantLSTM
from lq.optim import helper
from lq.tensor_quant import QuantDescriptor
from lq.utils import reduce_amax


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = QuantConv2d(1, 4, 3)
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
        self.fc = QuantLinear(4, 3)
        self.rnn = QuantLSTM(3, 5)


def _names(model, params):
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids[id(p)] for p in params]


def test_match_parameters_by_regex_once_each():
    m = _Model()
    expect = [n for n, _ in m.named_parameters() if "weight" in n and n.startswith(("conv1", "fc"))]
    assert _names(m, helper.match_parameters(m, [r"^conv1\.weight", r"^fc\.weight", r"^(conv1|fc)\.weight$"])) == expect
    assert _names(m, helper.match_parameters(m, [r"body\.1\."])) == ["body.1.weight", "body.1.bias"]
    assert list(helper.match_parameters(m, [r"body\.1\.wei$"])) == []


def test_group_parameters_feeds_an_optimizer():
    m = _Model()
    groups = helper.group_parameters(m, [[r"^conv1\."], [r"^body\.", r"^fc\.weight"]], lrs=[0.1, 0.01],
                                     momentums=[0.9, 0.8], weight_decays=[0.0, 1e-4])
    assert _names(m, groups[0]["params"]) == ["conv1.weight", "conv1.bias"]
    assert _names(m, groups[1]["params"]) == ["body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias",
                                              "fc.weight"]
    assert [(g["lr"], g["momentum"], g["weight_decay"]) for g in groups] == [(0.1, 0.9, 0.0), (0.01, 0.8, 1e-4)]
    opt = torch.optim.SGD(groups)
    before = m.fc.weight.detach().clone()
    m.fc.weight.grad = torch.ones_like(m.fc.weight)
    opt.step()
    assert torch.allclose(m.fc.weight.detach(), before - 0.01 * (1 + 1e-4 * before) * 1.0)
    assert "lr" not in helper.group_parameters(m, [["fc"]])[0]


def test_group_parameters_errors():
    with pytest.raises(TypeError, match="must be list of list of patterns"):
        helper.group_parameters(None, [["fc"], "conv1"])
    with pytest.raises(TypeError, match="must be list of list of patterns"):
        helper.group_parameters(None, "fc")
    for kw in ("lrs", "momentums", "weight_decays"):
        with pytest.raises(TypeError, match=rf"{kw} has 1 value\(s\) for 2 group\(s\).*must match"):
            helper.group_parameters(None, [["fc"], ["conv1"]], **{kw: [0.1]})
    with pytest.raises(ValueError, match="'fc.weight' matches group 0 and group 1"):
        helper.group_parameters(_Model(), [["fc"], ["weight"]])


def test_freeze_parameters():
    m = _Model()
    assert helper.freeze_parameters(m, [r"^body\.0\."]) == ["body.0.weight", "body.0.bias"]
    assert [n for n, p in m.named_parameters() if not p.requires_grad] == ["body.0.weight", "body.0.bias"]


def _ref_fake_quant_rows(w, amax):
    """8-bit fake quantization (full grid) written out, amax per output channel (dim 0)."""
    s = torch.tensor(127.0) / amax  # one division (127.0 / amax would be reciprocal(amax) * 127)
    return torch.clamp(torch.round(w * s), -128, 127) / s


def test_quant_weight_inplace(caplog):
    torch.manual_seed(0)
    m = _Model()
    m.conv1.weight_quantizer.amax = torch.full((4, 1, 1, 1), 0.2)  # static amax: weights beyond it are clipped
    conv_before, fc_before = m.conv1.weight.detach().clone(), m.fc.weight.detach().clone()
    rnn_before = m.rnn.weight_ih_l0.detach().clone()
    body_before = m.body[0].weight.detach().clone()
    with caplog.at_level(logging.WARNING):
        assert helper.quant_weight_inplace(m) == ["conv1.weight", "fc.weight"]
    assert torch.equal(m.conv1.weight.detach(), _ref_fake_quant_rows(conv_before, torch.full((4, 1, 1, 1), 0.2)))
    fc_amax = fc_before.abs().amax(dim=1, keepdim=True)  # dynamic per-row amax of the weight quantizer
    assert torch.equal(m.fc.weight.detach(), _ref_fake_quant_rows(fc_before, fc_amax))
    assert m.conv1.weight.requires_grad and m.conv1.weight.grad is None
    assert torch.equal(m.rnn.weight_ih_l0.detach(), rnn_before) and "rnn" in caplog.text
    assert torch.equal(m.body[0].weight.detach(), body_before)


def test_reduce_amax_against_numpy():
    x = (np.random.default_rng(0).random((3, 5, 4, 6)) - 0.3).astype(np.float32)
    t = torch.from_numpy(x)
    assert float(reduce_amax(t)) == np.abs(x).max()
    for axis in (1, (0, 2), (1, 2, 3), (-1,)):
        for keepdims in (True, False):
            expect = np.abs(x).max(axis=axis, keepdims=keepdims)
            assert np.array_equal(reduce_amax(t, axis=axis, keepdims=keepdims).numpy(), expect)
    # as in the reference toolkit: a one-element result of a tuple axis is squeezed, keepdims or not
    assert reduce_amax(t, axis=(0, 1, 2, 3)).shape == ()
    with pytest.raises(ValueError, match="cannot reduce 5 axes"):
        reduce_amax(t, axis=(0, 1, 2, 3, 0))
    g = torch.ones(3, requires_grad=True)
    assert not reduce_amax(g * 2).requires_grad
    assert lq.utils.reduce_amax is reduce_amax
