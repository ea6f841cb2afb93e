"""How a calibration batch becomes a model call: one rule (``lq.calibration.model_inputs``) for calibration,
``method="auto"`` and the export's sample batch.

A user's ``calibrate_model(model, [(input_ids, attention_mask), ...])`` on a two-input model raised
``TypeError: forward() missing 1 required positional argument: 'attention_mask'`` (the tuple was read as
``(inputs, target)``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lq.calibration import calibrate_model, default_forward, model_inputs, sample_inputs
from lq.convert import quantize_model

torch.set_flush_denormal(True)


def _tokens(n=64, length=12, seed=0):
    """Token ids from real text (sklearn digits' pixel values as a 17-symbol vocabulary) and a padding mask."""
    from sklearn.datasets import load_digits

    px = torch.tensor(load_digits().images[:n].reshape(n, 64)[:, :length], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    return px * mask, mask


class TwoInputs(nn.Module):
    """A text encoder's shape: ``forward(input_ids, attention_mask)``, a masked mean of token features."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(17, 16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, input_ids, attention_mask):
        h = self.fc2(torch.relu(self.fc1(self.emb(input_ids))))
        m = attention_mask[..., None].float()
        return (h * m).sum(1) / m.sum(1).clamp(min=1)


class OneInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 4)

    def forward(self, x, scale=None):  # one required input: a (x, y) batch is (inputs, target)
        return self.fc(x) * (1 if scale is None else scale)


def _calibrated(model_cls, batches, method="max"):
    torch.manual_seed(0)
    m = model_cls().eval()
    quantize_model(m)
    res = calibrate_model(m, batches, method=method)
    return m, res


def _same_amax(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("method", ["max", "auto"])
def test_tuple_of_the_inputs_is_passed_positionally(method):
    ids, mask = _tokens()
    as_dict = [{"input_ids": i, "attention_mask": m} for i, m in zip(ids.split(16), mask.split(16))]
    as_tuple = list(zip(ids.split(16), mask.split(16)))
    _, want = _calibrated(TwoInputs, as_dict, method)
    _, got = _calibrated(TwoInputs, as_tuple, method)
    _same_amax(got, want)
    if method == "auto":
        assert got.auto is not None and got.auto.chosen == want.auto.chosen


@pytest.mark.parametrize("shape", ["tuple_and_labels", "dict_and_labels", "list"])
def test_inputs_and_a_target(shape):
    ids, mask = _tokens()
    labels = torch.arange(len(ids)) % 2
    as_dict = [{"input_ids": i, "attention_mask": m} for i, m in zip(ids.split(16), mask.split(16))]
    _, want = _calibrated(TwoInputs, as_dict)
    parts = list(zip(ids.split(16), mask.split(16), labels.split(16)))
    if shape == "tuple_and_labels":
        batches = [((i, m), y) for i, m, y in parts]
    elif shape == "dict_and_labels":
        batches = [({"input_ids": i, "attention_mask": m}, y) for i, m, y in parts]
    else:
        batches = [[i, m] for i, m, _ in parts]
    _, got = _calibrated(TwoInputs, batches)
    _same_amax(got, want)


def test_inputs_and_target_for_a_one_input_forward_is_unchanged():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images[:64].reshape(64, 64)[:, 20:32], dtype=torch.float32) / 16.0
    y = torch.tensor(d.target[:64], dtype=torch.float32)[:, None].expand(64, 12) * 10  # a target far above x
    m, res = _calibrated(OneInput, list(zip(x.split(16), y.split(16))))
    assert float(m.fc._input_quantizer.amax) == pytest.approx(float(x.max()))
    _, plain = _calibrated(OneInput, list(x.split(16)))
    _same_amax(res, plain)


def test_a_batch_that_fits_no_shape_says_what_it_got_and_how_to_pass_it():
    ids, mask = _tokens(16)
    m = TwoInputs().eval()
    quantize_model(m)
    with pytest.raises(TypeError) as e:
        calibrate_model(m, [(ids, mask, mask, mask)], method="max")
    msg = str(e.value)
    assert "TwoInputs.forward(input_ids, attention_mask)" in msg and "takes 2 positional inputs" in msg
    assert "tuple of 4: (Tensor[16, 12], Tensor[16, 12], Tensor[16, 12], Tensor[16, 12])" in msg
    assert "dict of its inputs (model(**batch))" in msg
    assert "calibrate_model(..., forward=lambda model, batch: model(batch[0], batch[1]))" in msg
    # and a forward= that says how works
    res = calibrate_model(m, [(ids, mask, mask, mask)], method="max", forward=lambda mod, b: mod(b[0], b[1]))
    assert res


def test_the_rule_itself():
    ids, mask = _tokens(4)
    two, one = TwoInputs(), OneInput()
    assert model_inputs(two, {"input_ids": ids, "attention_mask": mask}) == ((), {"input_ids": ids,
                                                                               "attention_mask": mask})
    args, kw = model_inputs(two, (ids, mask))
    assert args[0] is ids and args[1] is mask and not kw
    args, kw = model_inputs(one, (ids, mask))
    assert len(args) == 1 and args[0] is ids and not kw
    assert model_inputs(one, ids)[0][0] is ids

    class Star(nn.Module):  # forward(*inputs): nothing to count, the first element as before
        def forward(self, *xs):
            return xs[0]

    assert model_inputs(Star(), (ids, mask))[0] == (ids,)

    class Step(nn.Module):  # a LightningModule-style calibration_step decides itself
        def forward(self, a, b):
            raise AssertionError("calibration_step should run")

        def calibration_step(self, batch):
            return batch["x"] * 2

    assert torch.equal(default_forward(Step(), {"x": ids}), ids * 2)


def test_the_export_sample_comes_from_the_same_rule():
    ids, mask = _tokens(4)
    two = TwoInputs()
    s = sample_inputs(two, {"attention_mask": mask, "input_ids": ids})  # forward's order, not the dict's
    assert isinstance(s, tuple) and s[0] is ids and s[1] is mask
    s = sample_inputs(two, ((ids, mask), torch.zeros(4)))
    assert s[0] is ids and s[1] is mask
    x = torch.rand(4, 12)
    assert sample_inputs(OneInput(), (x, torch.zeros(4))) is x

    from lq.callbacks.export import QuantExport

    class Trainer:  # what QuantExport._sample reads
        val_dataloaders = [[{"input_ids": ids, "attention_mask": mask}]]
        train_dataloader = None

    s = QuantExport()._sample(Trainer(), two)
    assert isinstance(s, tuple) and s[0] is ids and s[1] is mask
