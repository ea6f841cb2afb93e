"""INT4 weights on all-MiniLM-L6-v2 in onnxruntime: lq's MatMulNBits files against FP32 and onnxruntime's quantizer.

    python -m bench.int4            # the full run: docs/results/int4.md and int4.json
    python -m bench.int4 --fast     # the smoke twin (tests/test_bench_int4.py): small data, few repeats

Files, all run in onnxruntime (the sentence-embedding model of :mod:`bench.minilm`: ``input_ids,
attention_mask -> mean-pooled, L2-normalized embedding``; batch and sequence length dynamic):

* FP32: ``torch.onnx.export`` of the float model;
* onnxruntime's ``MatMulNBitsQuantizer`` on that file: its default algorithm (round-to-nearest, block 32,
  symmetric) and HQQ; GPTQ and the RTN config where they run offline (else the reason is in the table);
* lq PTQ: ``int4_block_weight`` (4-bit, blocks of 32 along the input features), calibrated on the Lee background
  news documents with ``CalibConfig.block_method`` = ``max`` (round-to-nearest), ``mse`` and ``awq``, and AWQ with
  ``keep_muls=False`` (activation scales only where ``1 / s`` folds into the op before: no Mul before any
  MatMulNBits), and ``gptq`` (that, then GPTQ's error-compensating rounding), exported by ``export_onnx``
  (MatMulNBits, verified against the fake-quant model);
* lq QAT: ``QuantCallback(quant="int4_block_weight", calib=awq, qat=QATConfig(distill_weight=...))`` fine-tuned
  on those documents (no labels: the loss is the cosine distance to the FP32 embedding, plus the callback's
  distillation term), then exported the same way.

Measured per file: size; cosine of its embeddings to the FP32 file's (mean and min) over the Pang-Lee sentences and
the Lee documents; sentiment accuracy of a logistic regression on its embeddings (Pang-Lee, repeated stratified
10-fold CV, the same folds for every file); Pearson with the human Lee similarities; latency at batch 1 x {1, 16,
128} tokens and 8 x 128 on one intra-op thread, every file timed in turn within each round (medians; ratios per
round, against FP32 and against onnxruntime's RTN file).
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench import _report as R
from bench import minilm as M

SHAPES = ((1, 1), (1, 16), (1, 128), (8, 128))
#: lq's block methods; "awq-folded": AWQ scaling only where 1 / s folds into the op before (no Mul in the file);
#: "gptq": that, then GPTQ's error-compensating rounding (CalibConfig(block_method="gptq"))
LQ_METHODS = ("default", "max", "mse", "awq", "awq-folded", "gptq")
#: the documents ``default`` calibrates on: calibrate_model's defaults with little data (issue 40, item 5)
DEFAULT_DOCS = 16
LQ_NAMES = {"default": f"lq PTQ default ({DEFAULT_DOCS} documents)", "max": "lq PTQ RTN", "mse": "lq PTQ MSE",
            "awq": "lq PTQ AWQ", "awq-folded": "lq PTQ AWQ, folded only", "gptq": "lq PTQ GPTQ (AWQ folded only)"}
ORT_ALGOS = ("rtn", "hqq", "gptq")
BLOCK = 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fast", action="store_true", help="smoke run: little data, few repeats, one QAT epoch")
    p.add_argument("--out", type=Path, default=None, help="output folder (default docs/results, fast: outputs/)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for calibration and QAT")
    p.add_argument("--qat-epochs", type=int, default=None, help="QAT epochs (default 2, fast 1; 0: no QAT)")
    return p.parse_args(argv)


# =========================================================================== files
def _tuple(batch: dict) -> tuple:
    return tuple(batch[n] for n in M.INPUT_NAMES)


def export_lq(emb: torch.nn.Module, sample: dict, path: Path, fast: bool):
    """lq's file of a calibrated SentenceEmbedding (verified; the legacy exporter in --fast: quicker)."""
    from lq.export import export_onnx

    return export_onnx(emb, _tuple(sample), str(path), opset=21, dynamo=not fast, input_names=list(M.INPUT_NAMES),
                       output_names=["sentence_embedding"], dynamic_dims=(1,),
                       check_fusion=False)


def lq_ptq(model, calib: list[dict], method: str) -> tuple[torch.nn.Module, list]:
    """A calibrated copy of ``model`` as a SentenceEmbedding with int4_block_weight and ``block_method``
    (``"awq-folded"``: AWQ with ``keep_muls=False``; ``"default"``: ``calibrate_model``'s defaults on the first
    :data:`DEFAULT_DOCS` documents)."""
    from lq.calib._block_search import search_block_scales
    from lq.calibration import calibrate_model
    from lq.callbacks.swap import QuantSwap

    emb = M.SentenceEmbedding(copy.deepcopy(model)).eval()
    QuantSwap("int4_block_weight").swap(emb)
    if method == "default":
        few, rows = [], 0
        for b in calib:
            if rows >= DEFAULT_DOCS:
                break
            few.append(_tuple(b))
            rows += len(b[M.INPUT_NAMES[0]])
        res = calibrate_model(emb, few, progress=False)
        return emb, list(res.block_choices)
    calibrate_model(emb, [_tuple(b) for b in calib], method="max", block_method="max")
    return emb, search_block_scales(emb, method.split("-")[0], [_tuple(b) for b in calib],
                                    keep_muls=method != "awq-folded")


class EmbeddingQAT:
    """The LightningModule for QAT of the sentence embedding without labels (built lazily: Lightning imports)."""

    @staticmethod
    def build(model, batches: list[dict], lr: float):
        import lightning as L

        class _Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = M.SentenceEmbedding(model)
                self._teacher = [M.SentenceEmbedding(copy.deepcopy(model)).eval()]  # not a submodule: not quantized

            def forward(self, input_ids, attention_mask):
                return self.model(input_ids, attention_mask)

            def training_step(self, batch, _):
                s = self(**batch)
                with torch.no_grad():
                    t = self._teacher[0](**batch)
                return (1 - (s * t).sum(-1)).mean()

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.0)

            def train_dataloader(self):  # pre-tokenized batches, shuffled each epoch (a list would be many loaders)
                return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=True,
                                                   generator=torch.Generator().manual_seed(0))

        return _Module()


def lq_qat(model, calib: list[dict], epochs: int, lr: float = 3e-5) -> torch.nn.Module:
    """QuantCallback(int4_block_weight, AWQ calibration, distilled QAT) on ``calib``; the quantized embedding.

    The learning rate, measured (cosine to FP32 of the fake-quant model, 128 tokens, AWQ start 0.9749): 3e-4 fell
    to 0.951 after one epoch, 1e-4 reached 0.977 after three, 3e-5 0.9806 after one and 0.9814 after two."""
    import lightning as L

    from lq import QuantCallback
    from lq.config import CalibConfig, ExportConfig, QATConfig

    lm = EmbeddingQAT.build(copy.deepcopy(model), calib, lr)
    cb = QuantCallback(quant="int4_block_weight",
                       calib=CalibConfig(method="max", block_method="awq", num_batches=len(calib)),
                       # lr is a fine-tuning LR already (measured above): the policy must not cut it to 1% again
                       qat=QATConfig(distill_weight=0.5, distill_temperature=0.05, lr_policy="none"),
                       export=ExportConfig(enabled=False), log_histograms=False, verbose=False)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(lm)
    return lm.model.eval()


def ort_quantized(fp32: Path, algo: str, calib: list[dict], path: Path) -> str:
    """onnxruntime's MatMulNBitsQuantizer on the FP32 file (block 32, 4 bits); '' or why it did not run."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization import matmul_nbits_quantizer as Q

    class _Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{n: b[n].numpy() for n in M.INPUT_NAMES} for b in calib])

        def get_next(self):
            return next(self.it, None)

    configs = {"rtn": lambda: Q.DefaultWeightOnlyQuantConfig(block_size=BLOCK, is_symmetric=True),
               "hqq": lambda: Q.HQQWeightOnlyQuantConfig(block_size=BLOCK),
               "gptq": lambda: Q.GPTQWeightOnlyQuantConfig(calibration_data_reader=_Reader(), block_size=BLOCK)}
    try:
        q = Q.MatMulNBitsQuantizer(onnx.load(str(fp32)), algo_config=configs[algo]())
        q.process()
        q.model.save_model_to_file(str(path), False)
        return ""
    except Exception as e:  # noqa: BLE001 - reported in the table: which algorithm does not run here, and why
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


# =========================================================================== measurements
def session(path: Path, threads: int):
    from lq.export.verify._verify import make_session

    return make_session(str(path), ["CPUExecutionProvider"], intra_op_num_threads=threads)


def file_embeddings(path: Path, tok_batches) -> torch.Tensor:
    """Embeddings of pre-tokenized batches from the file, in text order (as :func:`bench.minilm.embed`)."""
    sess = session(path, 2)
    encoded, order = tok_batches
    outs = [torch.from_numpy(sess.run(None, {n: b[n].numpy() for n in M.INPUT_NAMES})[0]) for b in encoded]
    emb = torch.cat(outs)
    back = torch.empty_like(emb)
    back[torch.as_tensor(order)] = emb
    return back


def kernels(path: Path) -> dict:
    from lq.export.verify._verify import optimized_op_counts

    ops = optimized_op_counts(str(path))
    return {"MatMulNBits": ops.get("MatMulNBits", 0), "float MatMul/Gemm": sum(ops.get(k, 0) for k in (
        "MatMul", "FusedMatMul", "Gemm", "FusedGemm")), "DequantizeLinear": ops.get("DequantizeLinear", 0)}


def latency(paths: dict[str, Path], tok, texts: list[str], repeats: int) -> dict:
    """Seconds per run at every SHAPE, all files in turn within each round: {shape: {name: [s per round]}}."""
    sessions = {k: session(p, 1) for k, p in paths.items()}
    enc = tok(texts[:8], padding="max_length", truncation=True, max_length=max(s for _, s in SHAPES),
              return_tensors="np")
    out = {}
    for b, s in SHAPES:
        feeds = {"input_ids": enc["input_ids"][:b, :s].astype(np.int64),
                 "attention_mask": np.ones((b, s), np.int64)}
        inner = max(1, int(64 / (b * s) ** 0.5))  # many short runs per round at 1 token, one at 8 x 128
        fns = {k: (lambda sess=sess: sess.run(None, feeds)) for k, sess in sessions.items()}
        out[f"{b}x{s}"] = R.interleaved(fns, repeats=repeats, inner=inner)
    return out


# =========================================================================== run
def main(argv=None) -> int:
    args = parse_args(argv)
    out, cmd, t0 = R.start_run(args)
    torch.set_flush_denormal(True)
    with tempfile.TemporaryDirectory(prefix="lq-int4-") as d:  # the ONNX files (~400 MB) never land in docs/
        return _run(args, out, cmd, t0, Path(d))


def _run(args, out: Path, cmd: str, t0: float, work: Path) -> int:
    fast = args.fast
    epochs = args.qat_epochs if args.qat_epochs is not None else (1 if fast else 2)
    info = R.machine()
    R.log(f"bench.int4 on {info['cpu']} ({info['isa']})")
    model, tok = M.load_model()
    data = M.load_text(fast=fast)
    seq = 32 if fast else 128
    calib = [{n: b[n] for n in M.INPUT_NAMES} for b in
             M.batches(tok, data.calib[:4] if fast else data.calib, batch_size=4 if fast else 16, max_length=seq)[0]]
    evals = M.batches(tok, data.eval_texts, batch_size=16, max_length=64 if fast else M.MAX_LENGTH)
    sample = M.fixed_length(tok, data.calib[:2], 16)

    paths: dict[str, Path] = {"FP32": work / "fp32.onnx"}
    M.export_fp32(model, str(paths["FP32"]), sample, dynamic_sequence=True)
    notes: dict[str, str] = {}
    for algo in ORT_ALGOS if not fast else ("rtn",):
        name = f"onnxruntime {algo.upper()}"
        why = ort_quantized(paths["FP32"], algo, calib, work / f"ort_{algo}.onnx")
        if why:
            notes[name] = f"did not run here: {why}"
            R.log(f"{name}: {notes[name]}")
        else:
            paths[name] = work / f"ort_{algo}.onnx"
    chosen: dict[str, list] = {}
    for method in LQ_METHODS if not fast else ("default",):  # gptq: the same file at 4 documents
        name = LQ_NAMES[method]
        emb, choices = lq_ptq(model, calib, method)
        res = export_lq(emb, sample, work / f"lq_{method}.onnx", fast)
        paths[name] = Path(res.path)
        chosen[name] = choices
        notes[name] = f"verified ({res.verdict})" if res.verified else "NOT verified"
        R.log(f"{name}: exported ({time.perf_counter() - t0:.0f} s), {notes[name][:40]}")
    if epochs:
        name = f"lq QAT ({epochs} epoch{'s' if epochs > 1 else ''}, distilled)"
        torch.set_num_threads(args.threads)
        emb = lq_qat(model, calib, epochs)
        res = export_lq(emb, sample, work / "lq_qat.onnx", fast)
        paths[name] = Path(res.path)
        notes[name] = f"verified ({res.verdict})" if res.verified else "NOT verified"
        R.log(f"{name}: exported ({time.perf_counter() - t0:.0f} s), {notes[name][:40]}")

    R.log(f"files written ({time.perf_counter() - t0:.0f} s)")
    folds = M.cv_folds(data.labels, n_repeats=1 if fast else 3)
    embs = {k: file_embeddings(p, evals) for k, p in paths.items()}
    rows = []
    for k, p in paths.items():
        q = M.quality(embs[k], embs["FP32"], data, folds)
        rows.append({"file": k, "size_mb": os.path.getsize(p) / 1e6, "mean_cos": q.mean_cos, "min_cos": q.min_cos,
                     "sentiment_acc": q.sentiment_acc, "pearson": q.pearson, "kernels": kernels(p),
                     "note": notes.get(k, "")})
    R.log(f"quality measured ({time.perf_counter() - t0:.0f} s)")
    times = latency(paths, tok, data.polarity, repeats=2 if fast else 15)
    ref = "onnxruntime RTN" if "onnxruntime RTN" in paths else None
    for r in rows:
        r["latency"] = {}
        for shape, t in times.items():
            r["latency"][shape] = {"ms": R.spread(t[r["file"]]), "vs_fp32": R.ratios(t["FP32"], t[r["file"]]),
                                   "vs_ort": R.ratios(t[ref], t[r["file"]]) if ref else None}
    seconds = time.perf_counter() - t0
    result = {"fast": fast, "machine": info, "command": cmd, "seconds": seconds, "rows": rows,
              "not_run": {k: v for k, v in notes.items() if k not in paths},
              "search": {k: [c.__dict__ for c in v] for k, v in chosen.items()}}
    R.write_json(out / "int4.json", result)
    (out / "int4.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(res: dict) -> str:
    info = res["machine"]
    shapes = [f"{b}x{s}" for b, s in SHAPES]
    head = ["file", "size MB", "mean cos", "min cos", "sentiment acc", "Pearson", "MatMulNBits / float MatMul"]
    rows = [[r["file"], f"{r['size_mb']:.1f}", f"{r['mean_cos']:.4f}", f"{r['min_cos']:.4f}",
             f"{100 * r['sentiment_acc']:.1f}%", f"{r['pearson']:.3f}",
             f"{r['kernels']['MatMulNBits']} / {r['kernels']['float MatMul/Gemm']}"] for r in res["rows"]]
    speed = [[r["file"]] + [f"{r['latency'][s]['ms']['median'] * 1e3:.2f} ms, {r['latency'][s]['vs_fp32']['median']:.2f}x"
                            + (f" ({r['latency'][s]['vs_ort']['median']:.2f}x ort)" if r['latency'][s]['vs_ort'] else "")
                            for s in shapes] for r in res["rows"]]
    parts = [
        "# INT4 weights on all-MiniLM-L6-v2 (onnxruntime)", "",
        f"CPU: {info['cpu']}, {info['isa']}; onnxruntime {_ort_version()}, 1 intra-op thread for latency. "
        f"1-minute load average when the run ended {str(info.get('load_average', '?')).split()[0]} on "
        f"{info.get('cores', '?')} cores (about 1 is this bench alone); every file is timed in turn within each round, "
        "so the ratios hold better than the absolute times.", "",
        R.machine_markdown(info, res["command"], res["seconds"]), "",
        "## Quality (embeddings from the files, against the FP32 file)", "", R.table(head, rows), "",
        "## Latency (median per run; speed ratio vs FP32, and vs onnxruntime's RTN file, per round)", "",
        R.table(["file"] + [f"batch x tokens {s}" for s in shapes], speed), "",
    ]
    if res["not_run"]:
        parts += ["## Not run here", ""] + [f"- {k}: {v}" for k, v in res["not_run"].items()] + [""]
    parts += ["## Notes", ""] + [f"- {r['file']}: {r['note']}" for r in res["rows"] if r["note"]]
    parts += [f"- {k}: {fold_note(v)}" for k, v in res.get("search", {}).items() if fold_note(v)]
    return "\n".join(parts) + "\n"


def fold_note(choices: list[dict]) -> str:
    """Where AWQ's ``1 / s`` went (lq.calib._awq_fold): folded into a LayerNorm or V's rows, or kept as a Mul."""
    scaled = [c for c in choices if c.get("alpha", 0) > 0]
    if not scaled:
        return ""
    rows = sum("output rows" in c.get("folded", "") for c in scaled)
    norms = sum(c.get("folded", "").startswith(("LayerNorm", "RMSNorm")) for c in scaled)
    kept = {tuple(c.get("group") or [c["layer"]]) for c in scaled if not c.get("folded")}
    return (f"AWQ scaled {len(scaled)} Linears' inputs; 1/s folded into V's output rows for {rows}, into a LayerNorm "
            f"for {norms}; {len(kept)} Mul(s) kept for the rest (one per input read: Q/K/V share one; a LayerNorm "
            "output that is also the residual, or a GELU output, takes no exact fold)")


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


if __name__ == "__main__":
    raise SystemExit(main())
