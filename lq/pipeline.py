"""The ``lq-train`` job: FP32 training, PTQ, QAT, ONNX INT8 export and evaluation in the target's runtime.

Used by the Hydra app (:mod:`lq.cli`) and callable from Python with a
:class:`lq.config.JobConfig`. Prints (and returns) one table: accuracy of
the FP32, PTQ and QAT models in PyTorch and of the exported INT8 model in
the runtime the export targets (onnxruntime; OpenVINO's CPU plugin for
``export.target=openvino``), model file sizes and latencies there.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import lightning as L
import numpy as np
import torch

from lq.config import JobConfig


@dataclass
class JobResult:
    """What the job measured; ``rows()`` gives the printed table."""

    accuracy: dict = field(default_factory=dict)  # stage -> accuracy in [0, 1]
    size_bytes: dict = field(default_factory=dict)  # file -> bytes
    latency_ms: dict = field(default_factory=dict)  # (model, batch) -> median ms
    #: batch -> INT8 speed over FP32: the export's speed check (lq.export.timing) run at that batch, whose medians
    #: are the latencies above
    speedup: dict = field(default_factory=dict)
    fp32_reference: Optional[str] = None  # which plain FP32 export the INT8 file was timed against
    onnx_max_abs_diff: Optional[float] = None
    runtime: str = "onnxruntime"  # where the INT8 file's accuracy, latency and max |diff| were measured
    files: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)  # the per-layer quantizer table (lq.report.quantizer_rows)
    eval_split: Optional[str] = None  # the DataModule's split the accuracies are measured on (None: none)
    selection: dict = field(default_factory=dict)  # "ptq"/"qat" -> accuracy on the split that chose the export
    exported: Optional[str] = None  # which model the ONNX file holds: "qat" or "ptq"
    notes: list = field(default_factory=list)  # what the user must know (QAT worse than PTQ, nothing measured)

    def rows(self) -> list[tuple[str, str]]:
        out = []
        names = {"fp32": "FP32 (PyTorch)", "ptq": "INT8 PTQ (PyTorch fake-quant)", "qat": "INT8 QAT (PyTorch fake-quant)",
                 "onnx_int8": f"INT8 ONNX ({self.runtime})", "onnx_fp32": f"FP32 ONNX ({self.runtime})"}
        split = f" [{self.eval_split}]" if self.eval_split and self.eval_split != "test" else ""
        for k, v in self.accuracy.items():
            out.append((f"accuracy: {names.get(k, k)}{split}", "not measured" if v is None else f"{100 * v:.2f}%"))
        if self.exported:
            out.append(("exported model", {"qat": "QAT", "ptq": "PTQ (QAT was less accurate)"}[self.exported]))
        for k, v in self.size_bytes.items():
            out.append((f"size: {k}", f"{v / 1024:.1f} KiB"))
        for (model, batch), ms in self.latency_ms.items():
            out.append((f"latency: {model}, batch {batch}", f"{ms:.3f} ms"))
        for batch, ratio in self.speedup.items():
            out.append((f"speedup INT8 vs FP32, batch {batch}", f"{ratio:.2f}x"))
        if self.fp32_reference:
            out.append(("FP32 file timed against", self.fp32_reference))
        if self.onnx_max_abs_diff is not None:
            out.append((f"{self.runtime} vs PyTorch max |diff| (sample batch)", f"{self.onnx_max_abs_diff:.3g}"))
        return out


def _instantiate(spec: dict, group: str = ""):
    """Build ``spec["_target_"]`` with the arguments it accepts.

    ``lq-train model._target_=my_pkg.MyModule`` overrides one key of the default preset, so the preset's
    other arguments (SmallCNN's ``num_classes``, ``channels`` ...) are still in the node; an argument the
    class does not take is left out with one warning naming it, instead of a TypeError.
    """
    import inspect
    import warnings

    from hydra.utils import get_class, instantiate

    spec = dict(spec)
    target = spec.get("_target_")
    try:
        params = inspect.signature(get_class(target)).parameters if target else {}
    except Exception:  # noqa: BLE001 - a function target or an import error: instantiate reports it
        params = {}
    if params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        dropped = sorted(k for k in spec if not k.startswith("_") and k not in params)
        if dropped:
            warnings.warn(f"lq-train: {target} takes no argument(s) {dropped}, so {group or 'the'} preset's values "
                          f"for them are not passed (give its own arguments as +{group or 'model'}.NAME=VALUE)",
                          stacklevel=2)
            for k in dropped:
                spec.pop(k)
    return instantiate(spec, _convert_="all")


def _data_spec(cfg: JobConfig) -> dict:
    """The datamodule's arguments, with the job's seed as its ``seed`` (split and shuffling) unless
    ``data.seed`` is given or the datamodule takes no ``seed``."""
    import inspect

    from hydra.utils import get_class

    spec = dict(cfg.data)
    if "seed" not in spec and "_target_" in spec:
        if "seed" in inspect.signature(get_class(spec["_target_"])).parameters:
            spec["seed"] = cfg.seed
    return spec


def _trainer(cfg: JobConfig, root: Path, max_epochs: int, callbacks=None) -> L.Trainer:
    kwargs = dict(cfg.trainer)
    kwargs.update(max_epochs=max_epochs, default_root_dir=str(root), callbacks=callbacks or [])
    return L.Trainer(**kwargs)


def _inputs_targets(loader):
    xs, ys = [], []
    for batch in loader:
        xs.append(batch[0])
        ys.append(batch[1])
    return torch.cat(xs), torch.cat(ys)


#: the DataModule's held-out splits, in the order the job measures accuracy on them
EVAL_SPLITS = ("test", "val")


def defined_splits(dm) -> list[str]:
    """Which of ``test``/``val`` the DataModule has a dataloader for, checked before any training.

    Most DataModules define only ``train_dataloader`` and ``val_dataloader``; Lightning's base class has a
    ``test_dataloader`` that raises, so the method must be the DataModule's own."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    out = []
    for split in EVAL_SPLITS:
        name = f"{split}_dataloader"
        if isinstance(dm, L.LightningDataModule):
            if is_overridden(name, dm, L.LightningDataModule):
                out.append(split)
        elif callable(getattr(dm, name, None)):
            out.append(split)
    return out


def _loader(dm, split: Optional[str]):
    return getattr(dm, f"{split}_dataloader")() if split else None


@torch.no_grad()
def accuracy(model: torch.nn.Module, loader) -> float:
    """Top-1 accuracy of a classifier over ``(inputs, targets)`` batches."""
    was = model.training
    model.eval()
    correct = total = 0
    device = next(model.parameters()).device
    for x, y in loader:
        pred = model(x.to(device)).argmax(1).cpu()
        correct += int((pred == y).sum())
        total += len(y)
    model.train(was)
    return correct / max(1, total)


def ort_session(path: str, threads: Optional[int] = None, providers=None):
    """A session on ``path`` in onnxruntime's CPU provider, or where ``providers`` says (OpenVINO's CPU plugin:
    :func:`lq.export.verify._verify.make_session`)."""
    from lq.export.verify import _verify

    return _verify.make_session(path, providers, intra_op_num_threads=threads)


def ort_accuracy(path: str, x: torch.Tensor, y: torch.Tensor, batch: int = 256,
                 providers=None) -> tuple[float, np.ndarray]:
    """Top-1 accuracy of the file at ``path`` on ``(x, y)`` in onnxruntime (or where ``providers`` says)."""
    sess = ort_session(path, providers=providers)
    name = sess.get_inputs()[0].name
    preds = []
    for i in range(0, len(x), batch):
        preds.append(sess.run(None, {name: x[i : i + batch].numpy()})[0].argmax(1))
    pred = np.concatenate(preds)
    return float((pred == y.numpy()).mean()), pred


def run_job(cfg: JobConfig, *, print_table: bool = True) -> JobResult:
    """Run the whole pipeline; see the module docstring.

    Accuracy is measured on the DataModule's test split, else its val split, else not at all (said in the
    table); the PTQ/QAT choice of ``export_best`` on val, else test. The FP32 and quantized checkpoints are
    written before anything after training that can fail (export, onnxruntime)."""
    torch.set_flush_denormal(True)
    L.seed_everything(cfg.seed, workers=True)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = JobResult()

    dm = _instantiate(_data_spec(cfg), "data")
    model = _instantiate(cfg.model, "model")
    splits = defined_splits(dm)  # before training: a missing loader must not cost the user a training run
    res.eval_split = splits[0] if splits else None
    select = "val" if "val" in splits else res.eval_split
    if res.eval_split is None:
        res.notes.append(f"{type(dm).__name__} has no test_dataloader or val_dataloader: no accuracy is measured, "
                         "and the QAT model is exported as trained")
    dm.setup("fit")
    if "test" in splits:
        dm.setup("test")

    # 1. FP32
    if cfg.fp32_epochs:
        fp32_trainer = _trainer(cfg, out / "fp32", cfg.fp32_epochs)
        fp32_trainer.fit(model, datamodule=dm)
        fp32_trainer.save_checkpoint(out / "fp32.ckpt")
    res.accuracy["fp32"] = _accuracy(model, dm, res.eval_split)

    # 2. PTQ: calibrate a copy, no training
    ptq = _ptq(cfg, model, dm)
    res.accuracy["ptq"] = _accuracy(ptq, dm, res.eval_split)

    # 3. QAT through the callback (calibrates again on its own, fine-tunes); the job exports after choosing
    qat, cb, trainer = _qat(cfg, model, dm, out)
    res.accuracy["qat"] = _accuracy(qat, dm, res.eval_split)
    qat_ckpt = out / "qat.ckpt"
    trainer.save_checkpoint(qat_ckpt)
    chosen = _choose(cfg, res, ptq, qat, dm, select, qat_ckpt, out)

    # 4. export the chosen model, then its runtime: accuracy, sizes and latency against the FP32 export
    int8_path = str((out / "model_int8.onnx").resolve())
    result = None
    if cfg.export.enabled:
        result = cb.exporter.run(trainer, ptq if chosen == "ptq" else qat, ckpt=str(qat_ckpt))
        res.exported = chosen
    res.onnx_max_abs_diff = getattr(result, "max_abs_diff", None)
    _runtime(res, model, dm, cfg.export.target, int8_path, out)

    from lq import report

    res.layers = report.with_kernels(list(getattr(cb, "summary_rows", []) or []), result)
    write_results(res, out)
    if print_table:
        print_results(res)
    return res


def _accuracy(model: torch.nn.Module, dm, split: Optional[str]) -> Optional[float]:
    """Top-1 accuracy on ``split`` (None: no split, or batches that are not ``(inputs, targets)``, said once)."""
    if split is None:
        return None
    try:
        return accuracy(model, _loader(dm, split))
    except (TypeError, ValueError, IndexError, RuntimeError) as e:
        import warnings

        warnings.warn(f"lq-train: no accuracy on the {split} data ({type(e).__name__}: {e}); the job measures "
                      "top-1 accuracy of a classifier on (inputs, targets) batches", stacklevel=2)
        return None


def _ptq(cfg: JobConfig, model: torch.nn.Module, dm) -> torch.nn.Module:
    """A calibrated copy of ``model``, no training."""
    from lq.calibration import calibrate_model
    from lq.callbacks import QuantSwap

    ptq = copy.deepcopy(model)
    QuantSwap(cfg.quant).swap(ptq)
    calibrate_model(ptq, dm.train_dataloader(), **cfg.calib.calibrate_kwargs())
    return ptq


def _qat(cfg: JobConfig, model: torch.nn.Module, dm, out: Path):
    """A copy of ``model`` through ``QuantCallback`` (swap, calibrate, QAT) with the callback's own export off:
    the job exports once it knows which of PTQ and QAT is better."""
    from lq.callbacks import QuantCallback

    qat = copy.deepcopy(model)
    export_cfg = copy.deepcopy(cfg.export)
    export_cfg.path = str((out / "model_int8.onnx").resolve())
    export_cfg.enabled = False
    cb = QuantCallback(cfg.quant, cfg.calib, cfg.qat, export_cfg, verbose=True)
    trainer = _trainer(cfg, out / "qat", cfg.qat_epochs, callbacks=[cb])
    trainer.fit(qat, datamodule=dm)
    return qat, cb, trainer


def _choose(cfg: JobConfig, res: JobResult, ptq, qat, dm, split: Optional[str], qat_ckpt: Path, out: Path) -> str:
    """``"qat"``, or ``"ptq"`` when QAT ended less accurate than PTQ on ``split`` and ``export_best`` is on; a
    QAT that made the model worse is said either way (and the PTQ model saved as a checkpoint of its own)."""
    if split is None or cfg.qat_epochs == 0:
        return "qat"
    if split == res.eval_split:  # measured already for the table (a DataModule with val and no test)
        p, q = res.accuracy.get("ptq"), res.accuracy.get("qat")
    else:
        p, q = _accuracy(ptq, dm, split), _accuracy(qat, dm, split)
    if p is None or q is None:
        return "qat"
    res.selection = {"ptq": p, "qat": q}
    if q >= p:
        return "qat"
    import warnings

    from lq.checkpoint import save_with_weights

    save_with_weights(qat_ckpt, ptq.state_dict(), out / "ptq.ckpt")  # lq.load_quantized reads it like the QAT one
    what = (f"QAT ended less accurate than PTQ on the {split} data ({100 * q:.2f}% vs {100 * p:.2f}%, "
            f"{100 * (q - p):+.2f} points)")
    if cfg.export.export_best:
        msg = f"{what}: the PTQ model is exported (its checkpoint: {out / 'ptq.ckpt'}; export.export_best=false keeps QAT)"
    else:
        msg = f"{what}; export.export_best=false, so the QAT model is exported anyway"
    res.notes.append(msg)
    warnings.warn(f"lq-train: {msg}", stacklevel=2)
    return "ptq" if cfg.export.export_best else "qat"


def _runtime(res: JobResult, model, dm, target: str, int8_path: str, out: Path) -> None:
    """INT8 accuracy on the eval split in the runtime ``target`` names (where the export verified the file), file
    sizes, and latency of both files there at batch 1 and 32."""
    from lq.export.verify import _verify

    providers = _verify.target_providers(target)  # tensorrt: onnxruntime's CPU provider, as the export verified
    res.runtime = _verify.runtime_name(providers)
    if res.eval_split is not None:
        x, y = _inputs_targets(_loader(dm, res.eval_split))
    else:  # no held-out data: a training batch is still a sample to time and export with
        x, y = _inputs_targets([next(iter(dm.train_dataloader()))])[0], None
    fp32_path = str(out / "model_fp32.onnx")
    res.files = {"int8": int8_path, "fp32": fp32_path}
    if os.path.exists(int8_path):
        if y is not None:
            res.accuracy["onnx_int8"], _ = ort_accuracy(int8_path, x, y, providers=providers)
        res.size_bytes["model_int8.onnx"] = os.path.getsize(int8_path)
    feeds = {b: [_batch(x, b).numpy()] for b in (1, 32)}
    fp32, res.fp32_reference = faster_fp32(model, x[:2], feeds[32], providers)
    Path(fp32_path).write_bytes(fp32)
    res.size_bytes["model_fp32.onnx"] = os.path.getsize(fp32_path)
    if not os.path.exists(int8_path):
        return
    from lq.export.timing import _timing

    int8 = Path(int8_path).read_bytes()
    for batch, f in feeds.items():  # the export's own measurement (interleaved rounds), at batch 1 and 32
        check = _timing.compare(int8, fp32, f, providers, batch=batch, reference=res.fp32_reference)
        res.latency_ms[("fp32", batch)], res.latency_ms[("int8", batch)] = check.fp32_ms, check.int8_ms
        res.speedup[batch] = check.ratio


def _batch(x: torch.Tensor, batch: int) -> torch.Tensor:
    """``batch`` rows of ``x`` (repeated where it has fewer)."""
    if len(x) < batch:
        x = torch.cat([x] * (batch // max(1, len(x)) + 1))
    return x[:batch]


def faster_fp32(model: torch.nn.Module, sample: torch.Tensor, feeds, providers=None) -> tuple[bytes, str]:
    """The user's FP32 file: ``torch.onnx.export`` of the float model with the current and the legacy exporter, the
    faster one on ``feeds`` (what the export's speed check compares with: lq.export.timing._speed.faster_plain)."""
    import io
    import warnings

    from lq.export.timing import _speed

    m = copy.deepcopy(model).eval().cpu()
    files = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            files["current"] = torch.onnx.export(
                m, (sample.cpu(),), dynamo=True, input_names=["input"], output_names=["output"],
                dynamic_shapes=({0: torch.export.Dim("batch", min=1)},), verbose=False).model_proto.SerializeToString()
        except Exception:  # noqa: BLE001 - the legacy file alone is then the reference
            pass
        buf = io.BytesIO()
        torch.onnx.export(m, (sample.cpu(),), buf, input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, dynamo=False, opset_version=17)
        files["legacy"] = buf.getvalue()
    _, data, reference = _speed.faster_plain(files, feeds, providers)
    return data, reference


def write_results(res: JobResult, out: Path) -> None:
    """``results.md`` and ``results.json`` next to the ONNX files: the results table and the per-layer one."""
    import json

    from lq import report

    lines = ["# lq-train results", "", "| measure | value |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in res.rows()]
    lines += [""] + [f"Note: {n}" for n in res.notes] if res.notes else []
    if res.layers:
        lines += ["", "## Quantizers", "", report.markdown_table(res.layers)]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    data = {"accuracy": res.accuracy, "size_bytes": res.size_bytes,
            "latency_ms": {f"{m}, batch {b}": v for (m, b), v in res.latency_ms.items()},
            "onnx_max_abs_diff": res.onnx_max_abs_diff, "files": res.files, "table": dict(res.rows()),
            "eval_split": res.eval_split, "selection": res.selection, "exported": res.exported, "notes": res.notes,
            "layers": res.layers}
    (out / "results.json").write_text(json.dumps(data, indent=2, default=str))


def print_results(res: JobResult) -> None:
    from rich.table import Table

    from lq.report import print_rich

    t = Table(title="lq-train results")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for k, v in res.rows():
        t.add_row(k, v)
    if res.notes:
        t.caption = "\n".join(f"Note: {n}" for n in res.notes)
    print_rich(t)
