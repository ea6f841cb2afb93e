"""``method="auto"``: choose each layer group's calibration method by how close the model stays to float.

No single method suits every activation: LayerNorm outputs carry a few huge channels that must not be
clipped, GELU outputs have long thin tails that should be, a post-ReLU conv input is spiky (TensorRT's
entropy clips it to nothing). ``auto`` collects histograms like the histogram methods, starts every input
quantizer at ``max`` and then, group by group, keeps whichever of max / percentile / mse / entropy brings
the quantized model's output closest to the float model's on the first calibration batches
(:func:`lq.sensitivity.calibration_method_search`). Groups are layer roles: module names with their
numeric indices wildcarded, so ``encoder.layer.0.attention.self.query`` ... ``layer.5`` choose together
(measured on all-MiniLM-L6-v2, 300 news documents: embeddings' mean cosine to FP32 0.991 where ``max``
gives 0.980; output R2 0.973 against max's 0.926, so the check below keeps the choice).

Closeness is :func:`lq.sensitivity.fidelity_metric`'s ``"r2"``: one minus the squared error of the output
relative to the float output's variance. Cosine, per sample, cannot see a score map that keeps its shape
at half its amplitude (every threshold on it moves: a text detector found no text at all); this metric
scores such a map, and a collapsed one, near or below 0.

Then the choice as a whole is checked against ``max`` everywhere, on the model's own output, over more
of the calibration batches (:data:`CHECK_BATCHES`, spread over the calibration data, the selection
batches among them): two selection batches can say nothing about the rest (blank pages first, a sorted
data set). When the choice scores below all-``max`` there, every group goes back to ``max``: the default
is never worse than ``max`` on the model's output over the calibration data it checked (measured on a
VGG-BN + U-Net text detector calibrated on 16 digit "pages", two blank ones first: the search's choice
scores R2 0.18 and the cosine search's -0.34 with no text found, max 0.997; ``auto`` now keeps max).

The float outputs the search and the check compare with are the calibration's range pass's (that pass runs
the model in float), and a batch scored once with some amaxes is not scored again, so the check costs two
forwards (the choice, max) per check batch the search did not score. The outcome (:class:`AutoResult`: the
choice per role, both scores, the gain) is logged on the ``lq`` logger, returned by :func:`lq.calibrate_model`
as ``.auto``, and shown in the summary table
(``auto: <method>`` in the method column, the outcome as its caption).

Where the model is a classifier (its output one row of class scores per sample), the choice is then tried
against NNCF's default activation range on every ``auto`` quantizer (``sample_mean``: each sample's largest
``|x|``, averaged over the samples), judged by what a classifier is for: on the check batches' rows, how often
the top-1 class agrees with float's. Output R2 is blind there: on a briefly trained full-size EfficientNetV2-S
(FP32 63.8%) the R2-chosen ranges score R2 0.992 and agree with float on 57.6% of the rows, the clipping
per-sample ranges score R2 0.01 (logits ten times smaller, the ranking right) and agree on 93.4%. ``max``
everywhere is judged the same way (an R2 choice can agree less often than max: 58.6% against 74.2% on a
near-untrained V2-S). Whichever of the two agrees more often replaces the choice only where an exact one-sided
McNemar test on the rows the two decide differently says it agrees more often (:data:`SIGNIFICANCE`): on
well-trained models they agree within a row or two of 256 and the choice stays (measured on the bench CNNs:
99.5 / 99.6%, 99.3 / 99.3%, 100 / 99.9%, 99.9 / 99.5%).

Under torch.distributed the metric is averaged over the ranks before every comparison, the check's
included, and the paired test's counts are summed over them, so every rank takes the same decisions (their
histograms are already reduced).

:mod:`lq.calibration` runs this module; it imports neither that nor :mod:`lq.sensitivity`: the search, the
metric and the layer helpers it shares with them live below all three, in :mod:`lq.calib._fidelity`.
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lq import progress as lq_progress
from lq.calib.calibrator import summed_over_ranks
from lq.calib._fidelity import (_glob_escape, agreement_rows, calibration_method_search, fidelity_metric, group_members,
                                quantized_layers)

#: what ``auto`` tries, in order (the first is where every group starts)
CANDIDATES = ("max", "percentile", "mse", "entropy")
#: the percentile candidate: the 99.99th clips LayerNorm outlier channels; 99.999 measured best on MiniLM
PERCENTILE = 99.999
#: calibration batches the per-role search runs on (the first ones)
SELECTION_BATCHES = 2
#: calibration batches the whole choice is checked against ``max`` on (the selection batches and more,
#: spread over the calibration data): two forwards each (the choice, max), the selection batches' already made
CHECK_BATCHES = 8
#: the most layer roles the search tries one by one; beyond, :func:`coarse_role` groups the layers
MAX_ROLES = 16
#: the fidelity metric of the search and of the check (:func:`lq.sensitivity.fidelity_metric`)
METRIC = "r2"
METRIC_NAME = "output R2 vs float (1 - squared error / variance of the float output)"
#: the range a classifier's choice is tried against, on every ``auto`` quantizer that can hold it (per tensor)
CLASSIFIER_ALTERNATIVE = "sample_mean"
#: it replaces the choice where the one-sided exact McNemar test on the check rows gives a p-value below this
SIGNIFICANCE = 0.05
TOP1_NAME = "top-1 agreement with float"
#: the attribute each ``auto`` quantizer gets with the method it ended with (the summary's method column)
CHOICE_ATTR = "auto_method"
#: ... and the one-line outcome (the choice per role, its score against max): the summary's caption
NOTE_ATTR = "auto_note"


@dataclass
class AutoResult:
    """What ``auto`` did.

    Attributes:
        chosen: ``{role: method}`` the per-role search picked.
        methods: ``{role: method}`` the model holds: ``chosen``, or ``max`` everywhere after a fall-back.
        fell_back: the choice scored below all-``max`` on the check, so every role went back to ``max``.
        metric: what ``auto_score`` and ``max_score`` measure (:data:`METRIC_NAME`).
        auto_score: the search's choice on the check batches (None when it chose ``max`` everywhere).
        max_score: ``max`` everywhere on the check batches.
        batches: check batches (this rank's).
        alternative: what replaced a classifier's choice by top-1 agreement: ``"sample_mean"``
            (:data:`CLASSIFIER_ALTERNATIVE` everywhere) or ``"max"`` (max everywhere), else None.
        agreement: ``(choice, alternative, max)``: top-1 agreement with float on the check rows where the
            alternative was tried (a classifier), else None.
        p_value: the paired test's one-sided p-value for the better-agreeing of the two agreeing more often than the
            choice.
    """

    chosen: dict[str, str]
    methods: dict[str, str]
    fell_back: bool = False
    metric: str = METRIC_NAME
    auto_score: float | None = None
    max_score: float | None = None
    batches: int = 0
    trace: list = field(default_factory=list, repr=False)
    alternative: str | None = None
    agreement: tuple[float, float, float] | None = None
    p_value: float | None = None

    @property
    def judged_by(self) -> str:
        """The :func:`lq.calib._fidelity.fidelity_metric` kind the final ranges were judged by: ``"top1"`` where
        an alternative replaced the choice, else :data:`METRIC`; a later step that must not undo the choice judges
        the same way."""
        return "top1" if self.alternative else METRIC

    @property
    def gain(self) -> float:
        """The model's score minus all-``max``'s on the check batches (0 after a fall-back: it is all-``max``)."""
        if self.fell_back or self.auto_score is None or self.max_score is None:
            return 0.0
        return self.auto_score - self.max_score

    @property
    def error_ratio(self) -> float | None:
        """The choice's squared output error over all-``max``'s (``(1 - auto_score) / (1 - max_score)``; below
        1 is better), None when the search kept ``max`` everywhere."""
        if self.auto_score is None or self.max_score is None:
            return None
        return (1.0 - self.auto_score) / (1.0 - self.max_score) if self.max_score < 1.0 else math.inf

    def __str__(self) -> str:
        return self._choice_text() + self._alternative_text()

    def _alternative_text(self) -> str:
        if self.agreement is None:
            return ""
        c, a, m = (f"{100 * v:.1f}%" for v in self.agreement)
        verdict = f"took {self.alternative} instead" if self.alternative else "kept the choice"
        return (f"; a classifier: {TOP1_NAME} {c} with it, {a} with {CLASSIFIER_ALTERNATIVE} ranges, {m} with max "
                f"(paired p = {self.p_value:.2g}): {verdict}")

    def _choice_text(self) -> str:
        choice = ", ".join(f"{g}: {m}" for g, m in self.chosen.items())
        if self.auto_score is None:
            return f"calibration method 'auto' kept max for every role ({choice})"
        on = f"{self.metric}, {self.batches} calibration batch(es)"
        ratio = f"{self.error_ratio:.2f}x"
        if self.fell_back:
            return (f"calibration method 'auto' fell back to max for every role: its per-role choice ({choice}) "
                    f"scored {self.auto_score:.5f} against max's {self.max_score:.5f}, {ratio} max's squared error "
                    f"({on})")
        return (f"calibration method 'auto' chose {choice}: {self.auto_score:.5f} against {self.max_score:.5f} with "
                f"max everywhere ({self.gain:+.5f}; {ratio} max's squared error; {on})")


def role(layer: str) -> str:
    """``encoder.layer.3.attention.self.query`` -> ``encoder.layer.*.attention.self.query``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", layer)


def coarse_role(layer: str) -> str:
    """:func:`role`, and the numbers that end the names of the modules around the layer wildcarded too:
    ``features.denseblock3.denselayer12.conv1`` -> ``features.denseblock*.denselayer*.conv1`` (the layer's own
    name keeps its number: ``conv1`` and ``conv2`` of a block stay apart)."""
    *outer, last = role(layer).split(".")
    return ".".join([re.sub(r"(?<=[A-Za-z_])\d+$", "*", p) for p in outer] + [last])


def groups(model: nn.Module, names: Iterable[str]) -> dict[str, list[str]]:
    """``{role: [exact globs of its layers]}`` for the quantized layers owning the quantizers ``names``.

    The search costs three whole-model evaluations per role. Repeated blocks numbered in their names rather than
    by a container's index (torchvision's DenseNet: ``denseblock3.denselayer12``) would each be a role of their
    own (DenseNet-121: 125 roles, 376 evaluations, 111 of its 165 s default path on a 2-core Xeon), so beyond
    :data:`MAX_ROLES` roles the blocks' numbers are wildcarded as well (:func:`coarse_role`; DenseNet-121: 5
    roles). Every bench model has at most 10 roles and keeps its own."""
    layers = quantized_layers(model)
    wanted = {n.rsplit(".", 1)[0] for n in names}
    chosen = [layer for layer in layers if layer in wanted or any(w.startswith(layer + ".") for w in wanted)]
    key = role if len({role(layer) for layer in chosen}) <= MAX_ROLES else coarse_role
    out: dict[str, list[str]] = {}
    for layer in chosen:
        out.setdefault(key(layer), []).append(_glob_escape(layer))
    return out


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _ddp_mean(metric: Callable[[nn.Module], float | None], process_group=None):
    """The metric averaged over the ranks that have selection batches (a rank without any joins every
    reduction with an empty contribution, so no rank waits for it)."""
    if not _distributed():
        return metric
    from lq.calib.calibrator import _comm_device

    def averaged(model):
        v = metric(model)
        t = torch.tensor([0.0 if v is None else float(v), 0.0 if v is None else 1.0], dtype=torch.float64,
                         device=_comm_device(None, process_group))
        torch.distributed.all_reduce(t, group=process_group)
        return float(t[0] / t[1]) if t[1] > 0 else 0.0

    averaged.higher_is_better = getattr(metric, "higher_is_better", True)
    return averaged


def choose(model: nn.Module, quantizers: list, methods: Mapping[str, str], batches: list,
           forward: Callable[[nn.Module, Any], Any], process_group=None,
           check: Sequence | None = None, reference: Sequence | None = None) -> AutoResult | None:
    """Set amax of the ``auto`` quantizers (already loaded at ``max``) by the search on ``batches`` (the
    selection batches), then check the choice against ``max`` everywhere on ``check`` (default: ``batches``)
    and fall back to ``max`` when it is worse. Returns what was done (None: nothing to choose).

    ``reference``: the float model's outputs on ``check`` where the calibration pass kept them
    (:func:`lq.calib._fidelity.output_rows`); else one float forward per check batch makes them. Each batch's
    score is kept per choice of amax, so the check costs forwards only for what the search did not score."""
    auto = [n for n, _ in quantizers if methods.get(n) == "auto"]
    grp = groups(model, auto)
    if not grp or (not batches and not _distributed()):
        return None
    check = list(batches if check is None else check)
    for n, q in quantizers:
        if n in auto:
            setattr(q, CHOICE_ATTR, "max")  # where they start (and stay, when the search cannot run)
            setattr(q, NOTE_ATTR, None)
    members = group_members(model, grp)
    moving = [q for qs in members.values() for q in qs]
    # auto quantizers outside the quantized layers (a residual add's, a pool's): max until a classifier's
    # alternative moves them too
    others = [q for n, q in quantizers if n in auto and all(q is not m for m in moving)]
    moving += others
    memo: dict = {}

    def state(m):
        return _amax_key(moving)

    known = {id(b): r for b, r in zip(check, reference or ())}
    try:
        if batches:
            sel = batches[:SELECTION_BATCHES]
            metric = fidelity_metric(model, sel, forward=forward, kind=METRIC, state=state, memo=memo,
                                     reference=[known.get(id(b)) for b in sel])
            known.update((id(b), r) for b, r in zip(sel, metric.reference))
        else:  # this rank's shard was empty: it still takes part in every reduction
            def metric(m):
                return None
    except Exception as e:  # noqa: BLE001 - any output we cannot compare: fall back, say so
        warnings.warn(f"calibration method 'auto' fell back to 'max': the model's output on a calibration batch "
                      f"is not a tensor to compare ({e}); choose a method, or give calibration a forward that "
                      "returns one", RuntimeWarning, stacklevel=3)
        return None
    tries = 1 + len(grp) * (len(CANDIDATES) - 1)
    with lq_progress.step("Calibration 'auto': methods per layer group", tries) as shown:
        search = calibration_method_search(model, _ddp_mean(metric, process_group), groups=grp,
                                           methods=CANDIDATES, percentile=PERCENTILE,
                                           progress=lambda msg: shown.advance(description=f"Calibration 'auto': {msg}"))
    chosen = dict(search.methods)
    result = AutoResult(chosen, dict(chosen), trace=search.trace)
    if any(m != "max" for m in chosen.values()):
        # the choice as a whole against max everywhere, on the model's output over the check batches (the
        # selection batches among them scored already: only the others run)
        if check:
            whole = fidelity_metric(model, check, forward=forward, kind=METRIC, state=state, memo=memo,
                                    reference=[known.get(id(b)) for b in check])
            known.update((id(b), r) for b, r in zip(check, whole.reference))
        else:
            def whole(m):
                return None
        whole = _ddp_mean(whole, process_group)
        result.batches = len(check)
        result.auto_score = float(whole(model))
        _load(members, {g: "max" for g in members})
        result.max_score = float(whole(model))
        if result.auto_score >= result.max_score:
            _load(members, chosen)
        else:
            result.fell_back = True
            result.methods = {g: "max" for g in chosen}
    classifier = int(bool(check) and bool(metric_info(metric).get("class_scores")))
    if summed_over_ranks([classifier], process_group)[0]:  # every rank alike (one without check batches adds no rows)
        _classifier_alternative(model, members, others, result, check, forward, state, memo, known, process_group)
    for g, qs in members.items():
        for q in qs:
            setattr(q, CHOICE_ATTR, result.methods[g] if not _holds_alternative(q, result) else result.alternative)
    for q in others:
        if _holds_alternative(q, result):
            setattr(q, CHOICE_ATTR, result.alternative)
    for n, q in quantizers:
        if n in auto:
            setattr(q, NOTE_ATTR, str(result))  # the summary table's caption
    logging.getLogger("lq").info("%s", result)
    return result


def metric_info(metric) -> dict:
    """What a :func:`lq.calib._fidelity.fidelity_metric` learnt of the output (empty for a stand-in metric)."""
    return getattr(metric, "info", None) or {}


def _can_hold_alternative(q) -> bool:
    return getattr(q.calibrator, "holds_sample_maxima", False)  # tracked only per tensor


def _holds_alternative(q, result: AutoResult) -> bool:
    return result.alternative is not None and _can_hold_alternative(q)


def _classifier_alternative(model, members, others, result: AutoResult, check, forward, state, memo, known,
                            process_group) -> None:
    """Judge a classifier's ranges by top-1 agreement with float on the ``check`` rows: the model as it stands (the
    choice, or max after a fall-back), max everywhere, and :data:`CLASSIFIER_ALTERNATIVE` on every ``auto``
    quantizer that holds it (the quantized layers' inputs in ``members`` and the ``others``, a residual add's or a
    pool's, which otherwise stay at max: one range rule for every grid, as NNCF's). The one of the other two that
    agrees more often replaces the choice where the paired test says it agrees more often than the choice."""
    movable = [q for qs in [*members.values(), others] for q in qs if _can_hold_alternative(q)]
    if not movable:
        return

    def restore():
        _load(members, result.methods)
        for q in others:
            q.load_calib_amax("max")

    top1 = fidelity_metric(model, check, forward=forward, kind="top1", state=state, memo=memo,
                           reference=[known.get(id(b)) for b in check])
    chosen = agreement_rows(top1, model, check, state, memo)
    _load(members, {g: "max" for g in members})
    at_max = agreement_rows(top1, model, check, state, memo)
    for q in movable:
        q.load_calib_amax(CLASSIFIER_ALTERNATIVE)
    alt = agreement_rows(top1, model, check, state, memo)
    n, agree_c, agree_a, agree_m, a_better, a_worse, m_better, m_worse = summed_over_ranks(
        [chosen.numel(), int(chosen.sum()), int(alt.sum()), int(at_max.sum()),
         int((alt & ~chosen).sum()), int((chosen & ~alt).sum()),
         int((at_max & ~chosen).sum()), int((chosen & ~at_max).sum())], process_group)
    result.agreement = (agree_c / max(n, 1), agree_a / max(n, 1), agree_m / max(n, 1))
    at_max_is_choice = all(m == "max" for m in result.methods.values())
    if agree_a >= agree_m or at_max_is_choice:
        result.p_value = mcnemar_p(a_better, a_worse)
        if result.p_value < SIGNIFICANCE:
            result.alternative = CLASSIFIER_ALTERNATIVE
            return
    else:
        result.p_value = mcnemar_p(m_better, m_worse)
        if result.p_value < SIGNIFICANCE:
            result.alternative = "max"
            result.methods = {g: "max" for g in result.methods}
    restore()


def mcnemar_p(better: int, worse: int) -> float:
    """One-sided exact McNemar test: the probability of at least ``better`` of the ``better + worse`` rows on
    which two models decide differently going one way, were each way equally likely (Binomial(n, 1/2))."""
    n = better + worse
    if n == 0:
        return 1.0
    return sum(math.comb(n, k) for k in range(better, n + 1)) / 2 ** n


def _amax_key(quantizers: Sequence) -> bytes:
    """The amaxes of ``quantizers`` as they stand, as one key: equal keys, equal quantized model (an asymmetric
    quantizer's range follows from its amax and its calibrator)."""
    return torch.cat([q.amax.detach().reshape(-1).double().cpu() for q in quantizers]).numpy().tobytes()


def check_indices(seen: int, n: int = CHECK_BATCHES) -> set[int]:
    """Which of ``seen`` calibration batches :func:`check_batches` takes: the selection batches and the rest
    spread evenly over the calibration data."""
    if seen <= n:
        return set(range(seen))
    rest = n - SELECTION_BATCHES
    keep = set(range(SELECTION_BATCHES))
    return keep | {SELECTION_BATCHES + round(i * (seen - 1 - SELECTION_BATCHES) / max(1, rest - 1))
                   for i in range(rest)}


def check_batches(batches: Iterable, seen: int, n: int = CHECK_BATCHES) -> list:
    """Up to ``n`` of the first ``seen`` batches of (replayable) ``batches``: the selection batches and the
    rest spread evenly over the calibration data."""
    keep = check_indices(seen, n)
    out = []
    for i, b in enumerate(batches):
        if i >= seen:
            break
        if i in keep:
            out.append(b)
    return out


def _load(members: Mapping[str, list], chosen: Mapping[str, str]) -> None:
    for g, qs in members.items():
        m = chosen[g]
        kw = {"percentile": PERCENTILE} if m == "percentile" else {}
        for q in qs:
            q.load_calib_amax(m, **kw)
