"""``method="auto"`` (the default): per layer role, the method that keeps the model closest to float.

Checked against a search written out here (coordinate descent over roles in model order, candidates in a
fixed order, a move kept only when the output's R2 to the float model -- one minus the squared error over the
float output's variance -- improves on the first two batches; then the choice kept only when it is no worse
than max everywhere on the calibration batches), on real data.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from lq.auto_calib import role
from lq.calibration import calibrate_model
from lq.convert import quantize_model
from lq.nn.modules._utils import QuantMixin
from lq.nn.modules.tensor_quantizer import TensorQuantizer


def _digits(n=128):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images[:n], dtype=torch.float32).reshape(n, 64) / 16.0
    return list(x.split(32))


class MLP(nn.Module):
    """Two blocks of the same shape (one role: blocks.*.fc1 ...) and a head."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc1": nn.Linear(64, 64), "fc2": nn.Linear(64, 64)})
                                    for _ in range(2))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        for b in self.blocks:
            x = x + b["fc2"](torch.nn.functional.gelu(b["fc1"](x)))
        return self.head(x)


def test_role_wildcards_numeric_indices():
    assert role("encoder.layer.3.attention.self.query") == "encoder.layer.*.attention.self.query"
    assert role("blocks.10.fc1") == "blocks.*.fc1" and role("head") == "head" and role("stem.0") == "stem.*"


def test_coarse_role_wildcards_the_numbers_of_the_blocks_around_a_layer():
    from lq.auto_calib import coarse_role

    assert coarse_role("features.denseblock3.denselayer12.conv1") == "features.denseblock*.denselayer*.conv1"
    assert coarse_role("features.transition2.conv") == "features.transition*.conv"
    assert coarse_role("layer1.0.conv1") == "layer*.*.conv1" and coarse_role("conv1") == "conv1"


class NumberedBlocks(nn.Module):
    """``n`` residual blocks named ``block1`` ... (as torchvision's DenseNet names its layers), two Linears each: one
    role per layer under :func:`role`."""

    def __init__(self, n: int):
        super().__init__()
        for i in range(1, n + 1):
            self.add_module(f"block{i}", nn.ModuleDict({"fc1": nn.Linear(64, 64), "fc2": nn.Linear(64, 64)}))
        self.head = nn.Linear(64, 10)
        self.n = n

    def forward(self, x):
        for i in range(1, self.n + 1):
            b = getattr(self, f"block{i}")
            x = x + b["fc2"](torch.relu(b["fc1"](x)))
        return self.head(x)


@pytest.mark.parametrize("n", [7, 12])
def test_many_numbered_blocks_choose_by_block_position(n):
    """7 blocks: 15 roles, each searched on its own (every bench model has at most 10); 12 blocks: 25 roles, over
    the limit, so the blocks' numbers are wildcarded: 3 roles, 10 evaluations instead of 76."""
    from lq.auto_calib import MAX_ROLES

    torch.manual_seed(0)
    model = NumberedBlocks(n).eval()
    batches = _digits()
    quantize_model(model, glue=False)
    res = calibrate_model(model, batches, method="auto", progress=False)
    roles = set(res.auto.chosen)
    if 2 * n + 1 <= MAX_ROLES:
        assert roles == {f"block{i}.fc{j}" for i in range(1, n + 1) for j in (1, 2)} | {"head"}
    else:
        assert roles == {"block*.fc1", "block*.fc2", "head"}
    assert len(res.auto.trace) == 1 + 3 * len(roles)  # max everywhere, then three candidates per role
    chosen = {q.auto_method for n_, q in _input_quantizers(model).items() if n_.startswith("block")}
    assert chosen <= set(res.auto.chosen.values())


def _input_quantizers(model):
    return {n: m for n, m in model.named_modules()
            if isinstance(m, TensorQuantizer) and not n.endswith("weight_quantizer") and ".lq_glue." not in n
            and not n.startswith("lq_glue.") and not n.endswith("_output_quantizer")}


def _r2(model, ref, batches):
    with torch.no_grad():
        out = torch.cat([model(b) for b in batches]).double()
    ref = torch.cat(ref).double()
    return float(1 - ((out - ref) ** 2).sum() / ((ref - ref.mean()) ** 2).sum())


def test_auto_equals_a_written_out_search_and_beats_max():
    torch.manual_seed(0)
    float_model = MLP().eval()
    batches = _digits()
    with torch.no_grad():
        ref = [float_model(b) for b in batches]

    auto = copy.deepcopy(float_model)
    quantize_model(auto, glue=False)
    res = calibrate_model(auto, batches, method="auto")

    # the written-out search, on histograms collected once (entropy collects them)
    mine = copy.deepcopy(float_model)
    quantize_model(mine, glue=False)
    calibrate_model(mine, batches, method="entropy")
    qs = _input_quantizers(mine)
    layers = [n for n, m in mine.named_modules() if isinstance(m, QuantMixin)]
    roles: dict[str, list[TensorQuantizer]] = {}
    for layer in layers:
        roles.setdefault(re.sub(r"\.\d+(?=\.|$)", ".*", layer), []).append(qs[layer + "._input_quantizer"])

    def load(group, method):
        for q in roles[group]:
            q.load_calib_amax(method, **({"percentile": 99.999} if method == "percentile" else {}))

    for g in roles:
        load(g, "max")
    choice = {}
    best = _r2(mine, ref[:2], batches[:2])
    max_score = _r2(mine, ref, batches)
    for g in roles:
        chosen = "max"
        for method in ("percentile", "mse", "entropy"):
            load(g, method)
            v = _r2(mine, ref[:2], batches[:2])
            if v > best:
                best, chosen = v, method
        load(g, chosen)
        choice[g] = chosen
    # the check: the choice as a whole against max everywhere, on all four calibration batches
    if _r2(mine, ref, batches) < max_score:
        for g in roles:
            load(g, "max")

    got = {n: q.amax for n, q in _input_quantizers(auto).items()}
    want = {n: q.amax for n, q in qs.items()}
    assert got.keys() == want.keys()
    for n in got:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)
    assert res.auto.chosen == choice
    if any(m != "max" for m in choice.values()):
        assert res.auto.max_score == pytest.approx(max_score) and res.auto.batches == 4
    assert _r2(auto, ref, batches) >= max_score


def test_auto_falls_back_to_max_when_the_output_is_not_a_tensor():
    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 4)

        def forward(self, x):
            return {"loss": self.fc(x).sum()}  # a 0-d value: nothing per sample to compare

    m = Scalar().eval()
    quantize_model(m)
    batches = _digits(64)
    with pytest.warns(RuntimeWarning, match="'auto' fell back to 'max'"):
        calibrate_model(m, batches, method="auto")
    assert float(m.fc._input_quantizer.amax) == pytest.approx(float(torch.cat(batches).abs().max()))


def test_lstm_weight_quantizer_lists_calibrate_as_weights():
    """QuantLSTM keeps its weight quantizers in a list: they take weight_method, not the activation method."""
    from lq.calibration import is_weight_quantizer, methods_for

    assert is_weight_quantizer("rnn._weight_quantizers.0") and is_weight_quantizer("fc._weight_quantizer")
    assert not is_weight_quantizer("rnn._input_quantizers.1") and not is_weight_quantizer("fc._input_quantizer")
    lstm = nn.LSTM(4, 8, num_layers=2)
    quantize_model(lstm := nn.Sequential(lstm))
    qs = [(n, m) for n, m in lstm.named_modules() if isinstance(m, TensorQuantizer)]
    methods = methods_for(qs, "auto")
    assert {m for n, m in methods.items() if "_weight_quantizers" in n} == {"max"}
    assert {m for n, m in methods.items() if "_input_quantizers" in n} == {"auto"}
