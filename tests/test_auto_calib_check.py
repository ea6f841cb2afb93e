"""``method="auto"`` is never worse than ``max`` on the model's own output over the calibration data.

The failing case is the one a user met with a pretrained text detector (VGG-BN features, a U-Net decoder
with upsample + concat, two score maps): ``auto`` chose per layer role on its first two calibration batches
and found no text at all where ``max`` kept the mask. Here a small detector of that shape is trained on
real handwritten digits placed on blank "pages", and the calibration set starts with two blank pages (a
scanner's first sheets, a sorted data set): on those batches entropy/mse look as good as max for every
role, and on the pages with text they wipe the score maps out.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lq.calibration import calibrate_model

torch.set_flush_denormal(True)

PAGE = 48  # the page is PAGE x PAGE pixels, a 12 x 12 digit on it
BATCH = 2


def _cbr(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())


class TextDetector(nn.Module):
    """VGG-BN-like encoder, U-Net decoder (bilinear upsample + concat), two raw score maps (region, link)."""

    def __init__(self, c=16):
        super().__init__()
        self.e1 = nn.Sequential(_cbr(1, c), _cbr(c, c))
        self.e2 = nn.Sequential(nn.MaxPool2d(2), _cbr(c, 2 * c), _cbr(2 * c, 2 * c))
        self.e3 = nn.Sequential(nn.MaxPool2d(2), _cbr(2 * c, 4 * c), _cbr(4 * c, 4 * c), _cbr(4 * c, 4 * c))
        self.d2 = nn.Sequential(_cbr(6 * c, 2 * c), _cbr(2 * c, 2 * c))
        self.d1 = nn.Sequential(_cbr(3 * c, c), _cbr(c, c))
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        a = self.e1(x)
        b = self.e2(a)
        c = self.e3(b)
        u = self.d2(torch.cat([F.interpolate(c, scale_factor=2, mode="bilinear", align_corners=False), b], 1))
        u = self.d1(torch.cat([F.interpolate(u, scale_factor=2, mode="bilinear", align_corners=False), a], 1))
        return self.head(u)


def _blur(t, k, s):
    g = torch.exp(-((torch.arange(k) - k // 2) ** 2) / (2 * s * s))
    g = g / g.sum()
    t = F.conv2d(t, g.view(1, 1, 1, k), padding=(0, k // 2))
    return F.conv2d(t, g.view(1, 1, k, 1), padding=(k // 2, 0))


def _pages(n_blank=0, seed=0):
    """Real 8x8 digits (sklearn), scaled to 12x12 at a random place on a textured page; the targets are
    CRAFT-like score maps (a blurred stroke map, a wider link map), peak 1."""
    from sklearn.datasets import load_digits

    d = load_digits()
    dig = F.interpolate(torch.tensor(d.images / 16.0, dtype=torch.float32)[:, None], size=12, mode="bilinear",
                        align_corners=False)
    g = torch.Generator().manual_seed(seed)
    n = len(dig)
    paper = 0.15 * torch.rand(n, 1, PAGE, PAGE, generator=g) + 0.1
    text = torch.zeros(n, 1, PAGE, PAGE)
    for k in range(n):
        i, j = torch.randint(0, PAGE - 12, (2,), generator=g).tolist()
        text[k, :, i:i + 12, j:j + 12] = dig[k]
    x = torch.maximum(paper, text)
    region = _blur(text, 5, 1.0)
    link = _blur(F.max_pool2d(text, 5, 1, 2), 7, 2.0)
    y = torch.cat([region / region.amax((2, 3), keepdim=True), link / link.amax((2, 3), keepdim=True)], 1)
    blank = 0.15 * torch.rand(n_blank, 1, PAGE, PAGE, generator=g) + 0.1
    return x, y, blank


@pytest.fixture(scope="module")
def detector():
    torch.manual_seed(0)
    x, y, blank = _pages(n_blank=2 * BATCH)
    model = TextDetector()
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        i = torch.randint(0, 1400, (16,), generator=g)
        loss = F.mse_loss(model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    # 16 calibration pages, two blank pages first
    calib = list(torch.cat([blank, x[1400:1412]]).split(BATCH))
    return model, calib, x[1500:1600], list(x[1400:1416].split(BATCH))


def _quantized(model, calib, method):
    from lq.callbacks.swap import QuantSwap
    from lq.config import QuantConfig

    q = copy.deepcopy(model)
    QuantSwap(QuantConfig()).swap(q)  # lq's default recipe
    res = calibrate_model(q, calib, method=method)
    return q, res


def _r2(q, ref_model, xs):
    with torch.no_grad():
        out, ref = q(xs).double(), ref_model(xs).double()
    return float(1 - ((out - ref) ** 2).sum() / ((ref - ref.mean()) ** 2).sum())


def _iou(q, ref_model, xs, threshold=0.4):
    """Text-mask IoU against the float model's mask (region map above CRAFT's low-text threshold)."""
    with torch.no_grad():
        p, t = q(xs)[:, 0] > threshold, ref_model(xs)[:, 0] > threshold
    return float((p & t).sum() / (p | t).sum().clamp(min=1))


def test_auto_never_worse_than_max_on_a_text_detector(detector):
    """Before the check, ``auto`` chose entropy/mse on the blank pages and the quantized detector found no
    text: IoU 0.000, R2 -0.34 on the calibration data, where max gives IoU 0.991, R2 0.997 (the R2 search
    alone: 0.18; with the check, max)."""
    model, calib, test, _ = detector
    data = torch.cat(calib)
    mx, _ = _quantized(model, calib, "max")
    auto, res = _quantized(model, calib, "auto")
    r2_max, r2_auto = _r2(mx, model, data), _r2(auto, model, data)
    iou_max, iou_auto = _iou(mx, model, data), _iou(auto, model, data)
    print(f"calibration data: max R2 {r2_max:.4f} IoU {iou_max:.3f}; auto R2 {r2_auto:.4f} IoU {iou_auto:.3f}")
    assert iou_max > 0.9 and r2_max > 0.99  # max keeps the text
    assert r2_auto >= r2_max - 1e-9
    assert iou_auto >= iou_max - 0.01
    assert _iou(auto, model, test) > 0.9  # and held-out pages keep their text


def test_the_fall_back_is_reported(detector, caplog):
    model, calib, _, _ = detector
    with caplog.at_level("INFO", logger="lq"):
        auto, res = _quantized(model, calib, "auto")
    a = res.auto
    assert a is not None and a.fell_back and a.batches == 8
    assert any(m != "max" for m in a.chosen.values()) and set(a.methods.values()) == {"max"}
    assert a.auto_score < a.max_score and a.gain == 0.0
    assert a.max_score == pytest.approx(_r2(auto, model, torch.cat(calib)), abs=0.02)  # 8 of the 8 batches
    msg = str(a)
    assert "fell back to max for every role" in msg and f"max's {a.max_score:.5f}" in msg
    assert msg in caplog.text
    # the summary's method column says what each auto quantizer ended with
    from lq import report

    rows = report.quantizer_rows(auto, {r: "auto" for r in (n for n, _ in auto.named_modules())})
    methods = {r["method"] for r in rows if r["quantizer"].endswith("_input_quantizer")}
    assert methods == {"auto: max"}
    assert report.rich_table(rows).caption == msg and report.markdown_table(rows).endswith("\n\n" + msg)


def test_check_batches_are_spread_over_the_calibration_data():
    from lq.auto_calib import check_batches

    batches = list(range(20))
    assert check_batches(batches, 5) == [0, 1, 2, 3, 4]
    got = check_batches(batches, 20)
    assert got[:2] == [0, 1] and got[-1] == 19 and len(got) == 8 and got == sorted(set(got))
    assert check_batches(iter(batches), 16)[-1] == 15  # only the batches calibration saw


def test_auto_still_beats_max_on_pages_with_text(detector):
    """The same detector calibrated on 16 pages that all carry text: auto's choice is kept, it is better than
    max on the calibration data, and the gain it reports is that difference."""
    model, _, test, calib = detector
    data = torch.cat(calib)
    mx, _ = _quantized(model, calib, "max")
    auto, res = _quantized(model, calib, "auto")
    r2_max, r2_auto = _r2(mx, model, data), _r2(auto, model, data)
    a = res.auto
    print(a)
    assert not a.fell_back and a.methods == a.chosen and any(m != "max" for m in a.chosen.values())
    assert r2_auto > r2_max and a.gain > 0
    assert a.gain == pytest.approx(r2_auto - r2_max, rel=0.3)  # on 8 of the 8 batches, per-batch float sums
    assert _iou(auto, model, test) > 0.95


# ====================================================================== torch.distributed
def _ddp_model():
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_auto_calib import MLP

    from lq.convert import quantize_model

    torch.manual_seed(2)
    m = MLP().eval()
    with torch.no_grad():
        m.blocks[0]["fc1"].weight[:4] *= 8  # a few outlier channels into the GELU: auto leaves max there
    quantize_model(m, glue=False)
    return m


def _ddp_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from sklearn.datasets import load_digits

        x = torch.tensor(load_digits().images[:256], dtype=torch.float32).reshape(-1, 64) / 16.0
        # the ranks see different data, in different amounts: alone, each would score the methods differently
        batches = list(x[:128].split(16)) if rank == 0 else list((1.5 * x[128:176]).split(16))
        m = _ddp_model()
        res = calibrate_model(m, batches, method="auto")
        a = res.auto
        torch.save({"amax": {k: v.clone() for k, v in res.items()},
                    "auto": (a.chosen, a.methods, a.fell_back, a.auto_score, a.max_score, a.batches),
                    "classifier": (a.alternative, a.agreement, a.p_value)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_the_same_decision(monkeypatch):
    import tempfile

    import torch.multiprocessing as mp

    import lq

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed unavailable")
    if not lq.extension_loaded():  # the children use the same kernels as this process (and never try a build)
        monkeypatch.setenv("LQ_DISABLE_EXT", "1")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_ddp_worker, args=(2, os.path.join(d, "init"), d), nprocs=2, join=True)
        r0, r1 = (torch.load(os.path.join(d, f"rank{r}.pt")) for r in (0, 1))
    assert r0["amax"].keys() == r1["amax"].keys()
    for k in r0["amax"]:
        assert torch.equal(r0["amax"][k], r1["amax"][k]), k
    (c0, m0, f0, a0, x0, b0), (c1, m1, f1, a1, x1, b1) = r0["auto"], r1["auto"]
    assert (c0, m0, f0) == (c1, m1, f1) and any(m != "max" for m in c0.values())
    assert a0 == a1 and x0 == x1 and a0 is not None  # the check ran, on rank-averaged scores
    assert (b0, b1) == (8, 3)
    # a classifier's paired test counts the rows of both ranks: the same verdict on each
    assert r0["classifier"] == r1["classifier"] and r0["classifier"][1] is not None
