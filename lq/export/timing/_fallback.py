"""Where the INT8 file is slower than the user's FP32 file, send quantized layers back to float until it is not.

The placement rules (:mod:`lq.rules.onnxruntime`, :mod:`lq.glue`) put Q/DQ where onnxruntime's benches measured
integer kernels faster; on a model or batch they did not foresee, the Q/DQ conversions can cost more than the
integer kernels save. The export then measures instead of predicting: it exports copies of the model with groups
of quantizers turned off, verifies each against that copy in PyTorch (so the file still computes exactly what
a model says), refuses a copy whose outputs move from the quantized model's beyond :data:`FIDELITY` (a model
trained quantized can compute something else without its quantizers), times each against the same FP32 file,
and keeps a copy only where the timing says it is faster.

The groups, in the order they are tried (:func:`groups`):

1. the layers onnxruntime runs in float between Q/DQ (the kernel report names them): their conversions are pure
   cost;
2. the model's stages from the output backwards (consecutive blocks of the forward, by module path): the last
   stages work on the smallest maps, where a Q/DQ pair costs most against the work it saves;
3. right after a stage is kept, the stages next to it, tried again if this pass tried them already (a float
   stage beside a float one saves a Q/DQ pair more than either alone);
4. after a pass that kept something, the groups not kept again (on the new base);
5. when the file is still slower, every quantizer off: the float model, as fast as the FP32 file (the file is
   then float, and says so); kept where it reaches FP32 and the best file did not, in any rounds, since it
   computes what the FP32 file does (a float model timed 1.01x in rounds of 0.99-1.03x, against a best file of
   0.98x, had been refused as noise, and the 0.98x file saved).

Each try adds its group to what the best file so far has in float. The search stops once the file is at least as
fast as FP32, when every group was tried, or when the next try would overrun the time budget
(``ExportConfig.fallback_seconds``), which always keeps room for the last resort: a file left slower than FP32
because the budget ran out before the float model was tried is what the fallback exists to prevent. Timing
decides (:func:`faster`): noise alone must not send layers to float, nor hide a real gain.
The search itself takes its export and its measurement as functions, so its logic is tested on exact timings.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch
from torch import nn

from lq.export._files import short
from lq.export.prepare._model_checks import _is_quantizer, _quantizer_enabled, export_mode
from lq.export.timing._timing import SpeedCheck
from lq.glue._rules import CHILD

#: a try is kept when the lower quartile of its per-round ratios beats the best ratio so far by this fraction
#: (the ratio of one measurement moves by a few percent between runs on a quiet machine)
KEEP = 0.01
#: or, in rounds too noisy for that, when its median beats the best's by this fraction and its lower quartile the
#: best's lower quartile: MobileNetV3-style at 224x224 on a loaded 2-core machine timed its float model at 0.99x
#: (rounds 0.84-1.19x) against a best file of 0.84x (0.71-1.01x), and the 0.84x file was saved
KEEP_NOISY = 0.05
#: at most this many stages (consecutive blocks by module path) are tried
MAX_STAGES = 8
#: a copy whose PyTorch outputs on the sample are further than this from the model's (relative L2 norm) is not a
#: candidate: quantizers off must not change what the model computes beyond what quantizing it changed (PTQ of
#: bench.fallback's digits models: 0.5% and 3.8%; a model trained with QAT from scratch runs far off without them).
#: Not applied to a model calibrated and not trained since (:mod:`lq.calib._stamp`): with its quantizers off it is
#: the user's own model (a MobileNetV3-style net moved 12% and its float model was refused: the file ran at 0.68x)
FIDELITY = 0.10
#: what the first group is called
BETWEEN_QDQ = "the layers onnxruntime ran in float between Q/DQ"
#: the last resort: every quantizer off (the float model, as fast as the FP32 file)
EVERY = "every layer"


@dataclasses.dataclass(frozen=True)
class Group:
    """Quantizers to turn off together, and the layers they belong to."""

    label: str
    quantizers: tuple[str, ...]
    layers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Try:
    """One candidate file: the group it added, its speed check (None when its export or verification failed)."""

    group: Group
    check: SpeedCheck | None
    kept: bool
    error: str = ""
    seconds: float = 0.0
    #: faster, but refused by the search's guard (slower at the batch it guards), and why
    refused: str = ""

    def text(self) -> str:
        what = f"{self.group.label} ({len(self.group.layers)} layer(s))"
        if self.check is None:
            return f"{what}: not usable ({self.error})"
        verdict = ", kept" if self.kept else (f", faster but not kept: {self.refused}" if self.refused else
                                               ", not faster")
        spread = f"per-round {self.check.ratio_p25:.2f}-{self.check.ratio_p75:.2f}x"
        return f"{what}: {self.check.ratio:.2f}x ({spread}){verdict}"


@dataclasses.dataclass
class Fallback:
    """What the search did (``ExportResult.fallback``).

    Attributes:
        layers: the layers sent back to float in the file the export kept (empty: none was, the file is the
            one with every quantizer the model has).
        quantizers: their quantizers, as module paths of the model.
        before: the speed check of the file with every quantizer; after: that of the file kept.
        tries: every candidate, in order. stopped: why the search ended.
        started_from: the layers already float in the file the search started from (a search before it kept
            them; ``layers`` includes them).
    """

    layers: list[str]
    quantizers: list[str]
    before: SpeedCheck
    after: SpeedCheck
    tries: list[Try]
    stopped: str
    started_from: list[str] = dataclasses.field(default_factory=list)

    def note(self) -> str:
        """One warning: what was measured, what went back to float (or that nothing did), and why it stopped."""
        tried = "; ".join(t.text() for t in self.tries) or "nothing"
        at = f" at batch {self.before.batch}" if self.before.batch is not None else ""
        start = f"the file with {len(self.started_from)} layer(s) in float" if self.started_from else \
            "the file with every quantizer"
        if self.layers:
            shown = ", ".join(self.layers[:12]) + (f" and {len(self.layers) - 12} more" if len(self.layers) > 12
                                                   else "")
            head = (f"{start} ran at {self.before.ratio:.2f}x the speed of FP32{at}, so lq sent "
                    f"{len(self.layers)} layer(s) back to float in the file, where timing said that is faster: {shown}."
                    f" The file now runs at {self.after.ratio:.2f}x ({self.after.details()}) and computes the model "
                    "with those layers' quantizers off (verified so)")
        else:
            head = (f"the file runs at {self.before.ratio:.2f}x the speed of FP32{at}; lq tried copies with layers "
                    "back in float and kept none (none was faster, or usable: see each try), so the file keeps "
                    + (f"its {len(self.started_from)} float layer(s)" if self.started_from else "every quantizer"))
        return f"{head}. Tried: {tried}. Stopped: {self.stopped}"


# =========================================================================== the groups
def call_order(model: nn.Module, args: tuple) -> list[str]:
    """The model's enabled quantizers (module paths; a shared one under its first name) in the order the forward
    calls them on ``args``. A quantizer the forward does not call comes last, in module order."""
    named = {}
    for name, m in model.named_modules():
        if _is_quantizer(m) and _quantizer_enabled(m):
            named.setdefault(id(m), (name, m))
    order: list[str] = []
    handles = [m.register_forward_pre_hook(lambda mod, _in, name=name: order.append(name))
               for name, m in named.values()]
    try:
        with torch.no_grad(), export_mode(model):
            model(*args)
    finally:
        for h in handles:
            h.remove()
    seen = list(dict.fromkeys(order))
    return seen + [name for name, _ in named.values() if name not in set(seen)]


def owner(quantizer: str) -> str:
    """The layer a quantizer belongs to: the module holding it, or for a glue quantizer (``<module>.lq_glue.<op>``)
    the glue op itself."""
    parts = quantizer.split(".")
    if len(parts) >= 2 and parts[-2] == CHILD:
        return quantizer
    return ".".join(parts[:-1]) or quantizer


def _block(quantizer: str, depth: int) -> str:
    """The module path, ``depth`` components deep, of the block a quantizer is in (glue ops belong to the module
    whose forward calls them; "" for the model's own forward)."""
    parts = quantizer.split(".")
    parts = parts[:parts.index(CHILD)] if CHILD in parts else parts[:-1]
    return ".".join(parts[:depth])


def _runs(order: Sequence[str], depth: int) -> list[list[str]]:
    """Consecutive quantizers in the same block at ``depth``; the model's own glue joins the run before it."""
    runs: list[list[str]] = []
    key = None
    for q in order:
        k = _block(q, depth)
        if runs and (k == key or k == ""):
            runs[-1].append(q)
            continue
        runs.append([q])
        key = k
    return runs


def stages(order: Sequence[str], max_stages: int = MAX_STAGES) -> list[list[str]]:
    """The forward's quantizers in consecutive stages: the blocks at the shallowest module depth that splits the
    model into at least 4 (or as many layers as there are), merged into at most ``max_stages`` of about equal
    size."""
    if not order:
        return []
    deepest = max(len(q.split(".")) for q in order)
    want = min(4, len({owner(q) for q in order}))
    runs = _runs(order, 1)
    for depth in range(1, deepest + 1):
        runs = _runs(order, depth)
        if len(runs) >= want:
            break
    if len(runs) <= max_stages:
        return runs
    total = sum(map(len, runs))
    merged: list[list[str]] = [[] for _ in range(max_stages)]
    done = 0
    for run in runs:  # each run to the stage its middle falls in: consecutive, and about equal in size
        merged[min(max_stages - 1, int((done + len(run) / 2) * max_stages / total))].extend(run)
        done += len(run)
    return [m for m in merged if m]


def _group(label: str, quantizers: Sequence[str]) -> Group:
    return Group(label=label, quantizers=tuple(quantizers), layers=tuple(dict.fromkeys(owner(q) for q in quantizers)))


def groups(order: Sequence[str], float_layers: Sequence[str]) -> list[Group]:
    """What the search tries, in order: the layers run in float between Q/DQ (``float_layers``, the kernel
    report's names), then the stages from the output backwards."""
    out = []
    between = [q for q in order if owner(q) in set(float_layers)]
    if between:
        out.append(_group(BETWEEN_QDQ, between))
    for stage in reversed(stages(order)):
        first, last = owner(stage[0]), owner(stage[-1])
        out.append(_group(f"stage {first}" + (f" .. {last}" if last != first else ""), stage))
    return out


def check_fidelity(got: Sequence, want: Sequence) -> float:
    """The relative L2 distance of a copy's outputs ``got`` from the model's ``want`` (numpy arrays, in order);
    raises ValueError beyond :data:`FIDELITY`."""
    import numpy as np

    num = sum(float(np.sum((np.asarray(g, np.float64) - np.asarray(w, np.float64)) ** 2)) for g, w in zip(got, want))
    den = sum(float(np.sum(np.asarray(w, np.float64) ** 2)) for w in want)
    moved = (num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else float("inf"))
    if not moved <= FIDELITY:
        raise ValueError(f"with these quantizers off the model's outputs move {moved:.1%} from the quantized "
                         f"model's (relative L2 on the sample; at most {FIDELITY:.0%} allowed)")
    return moved


def faster(check: SpeedCheck, was: SpeedCheck) -> bool:
    """Whether a try's timing says its file is faster than the best so far: its rounds' lower quartile above the
    best's median (:data:`KEEP`); or its median well above the best's with its lower quartile above the best's
    (:data:`KEEP_NOISY`, for rounds whose spread hides a real gain); or it reaches FP32 where the best did not,
    in rounds that agree."""
    if check.ratio_p25 > was.ratio * (1 + KEEP):
        return True
    if check.ratio > was.ratio * (1 + KEEP_NOISY) and check.ratio_p25 > was.ratio_p25:
        return True
    return check.ratio >= 1.0 > was.ratio and not check.noisy


def batch_guard(best: SpeedCheck, measure: Callable[[bytes], SpeedCheck]) -> Callable[[bytes], str | None]:
    """The batch-1 search's guard (:func:`search`): a try faster at batch 1 is timed at the speed check's own batch
    too (``measure``) and refused where it is slower there than the best file so far (that file's rounds beat it,
    :func:`faster`) or falls below FP32 where that file was not; one let through becomes the best there
    (``guard.best()`` gives its check). A file is never made slower at the batch the user exported with to gain at
    batch 1."""
    state = {"best": best}

    def guard(data: bytes) -> str | None:
        check, was = measure(data), state["best"]
        if faster(was, check) or check.ratio < 1.0 <= was.ratio:
            at = f" at batch {check.batch}" if check.batch is not None else ""
            return f"{check.ratio:.2f}x{at}, where the best file runs {was.ratio:.2f}x"
        state["best"] = check
        return None

    guard.best = lambda: state["best"]  # type: ignore[attr-defined]
    return guard


def disable(model: nn.Module, quantizers: Sequence[str]) -> None:
    """Turn off these quantizers (module paths) of ``model``."""
    for name in quantizers:
        model.get_submodule(name).disable()


# =========================================================================== the search
def _neighbours(g: Group, tried: Sequence[Group], off: frozenset, failed: set) -> list[Group]:
    """The groups next to ``g`` in the forward (the stages before and after it) that are not float yet. A stage in
    float between integer ones costs a DequantizeLinear and a QuantizeLinear at each end; once one of its
    neighbours is float too, one pair goes, so a stage that did not pay on its own can pay beside one that did
    (bench.styles' EfficientNet-style net at 32x32: its second block in float alone 0.81x, beside the first 0.90x).
    Trying them right after a keep grows the float region from where it paid instead of waiting for the next
    pass over every group."""
    if g.label in (BETWEEN_QDQ, EVERY):  # not a stage: no place in the forward
        return []
    i = tried.index(g)
    return [h for h in (tried[j] for j in (i + 1, i - 1) if 0 <= j < len(tried))
            if h.label != BETWEEN_QDQ and h.label not in failed and not set(h.quantizers) <= off]


def search(first: SpeedCheck, tried: Sequence[Group], export: Callable[[frozenset], tuple[bytes, object]],
           measure: Callable[[bytes, float], SpeedCheck], budget_s: float, try_s: float, *,
           base: Fallback | None = None, guard: Callable[[bytes], str | None] | None = None
           ) -> tuple[Fallback, object | None]:
    """Try the groups in order (see the module's docstring); returns the record and what ``export`` gave for the
    file kept (None: the first file stays).

    After a keep, the kept group's neighbours are tried next (:func:`_neighbours`), again if this pass tried them
    already. A pass that kept a group is followed by another over the groups not kept (the base they were tried on
    has changed); when passes end with the file still slower, the last try has every quantizer off (the float model,
    which is as fast as the FP32 file). ``export(off)``: the file with the quantizers ``off`` turned off, as
    ``(bytes, payload)``; it raises when that file cannot be exported or does not verify. ``measure(bytes, below)``:
    its speed check against the FP32 file, which may stop once its first rounds rule out a ratio above ``below``,
    the best ratio so far (:func:`lq.export.timing._timing.hopeless`: a try that cannot be kept need not be timed
    to the end). ``try_s``: the expected seconds of one try, until one has been timed.

    ``base``: a search kept before (its float layers are where this one starts: ``first`` times that file).
    ``guard(bytes)``: asked about a try that would be kept; a reason refuses it (the batch-1 search keeps nothing
    that is slower at the speed check's own batch, :func:`batch_guard`).
    """
    start = time.perf_counter()
    best = {"check": first, "off": frozenset(base.quantizers) if base else frozenset(), "payload": None,
            "layers": list(base.layers) if base else []}
    tries: list[Try] = []
    failed: set[str] = set()
    timed: set[frozenset] = set()  # the candidates tried (each is the set of quantizers it has off)

    def attempt(g: Group, reserve: int = 1) -> str | None:
        """Export, verify and time the best file so far with ``g`` off too; a reason to stop, or None. ``reserve``:
        tries the budget must still hold after this one (the last resort's)."""
        nonlocal try_s
        off = best["off"] | frozenset(g.quantizers)
        if off == best["off"] or (off in timed and g.label != EVERY):  # nothing new, or this file was timed
            return None
        spent = time.perf_counter() - start
        if spent + try_s * (1 + reserve) > budget_s:
            return (f"the next try would overrun the time budget ({spent:.0f} s spent, about {try_s:.0f} s a try, "
                    f"fallback_seconds={budget_s:g}{', one try kept for the float model' if reserve else ''})")
        timed.add(off)
        t0 = time.perf_counter()
        try:
            data, payload = export(off)
            check = measure(data, best["check"].ratio)
        except Exception as e:  # noqa: BLE001 - a copy that does not export or verify is not a candidate
            failed.add(g.label)
            tries.append(Try(g, None, False, f"{type(e).__name__}: {short(e, 200)}", time.perf_counter() - t0))
            try_s = max(try_s, time.perf_counter() - t0)
            return None
        was = best["check"]
        # the float model computes what the FP32 file does, so its rounds straddle 1.0 by nature: reaching FP32
        # where the best file did not is enough, however noisy (faster() asks a stage for rounds that agree)
        keep = faster(check, was) or (g.label == EVERY and check.ratio >= 1.0 > was.ratio)
        refused = guard(data) if keep and guard is not None else None
        keep = keep and not refused
        tries.append(Try(g, check, keep, seconds=time.perf_counter() - t0, refused=refused or ""))
        try_s = time.perf_counter() - t0
        if keep:
            best.update(check=check, off=off, payload=payload,
                        layers=best["layers"] + [x for x in g.layers if x not in best["layers"]])
        return None

    stopped = None
    pending = list(tried)
    while pending and stopped is None and best["check"].ratio < 1.0:
        before = best["off"]
        queue = list(pending)
        while queue and best["check"].ratio < 1.0:
            g = queue.pop(0)
            was = best["off"]
            stopped = attempt(g)
            if stopped:
                break
            if best["off"] != was:  # kept: its neighbours next, those tried in this pass again (see _neighbours)
                near = _neighbours(g, tried, best["off"], failed)
                queue = near + [h for h in queue if h not in near]
        if best["off"] == before:  # a pass that kept nothing: another would not either
            break
        pending = [g for g in pending if g.label not in failed and not set(g.quantizers) <= best["off"]]
    every = list(dict.fromkeys(q for g in tried for q in g.quantizers))
    if best["check"].ratio < 1.0 and every:  # the budget kept this try: a file slower than FP32 is not the end
        ran_out = stopped
        stopped = attempt(_group(EVERY, every), reserve=0)
        if stopped is None and ran_out:
            stopped = f"{ran_out}; the float model was tried last"
    if stopped is None:
        stopped = (f"the file runs at {best['check'].ratio:.2f}x, at least as fast as FP32"
                   if best["check"].ratio >= 1.0 else "every group was tried")
    kept = best["payload"] is not None
    record = Fallback(layers=best["layers"] if kept else [], quantizers=sorted(best["off"]) if kept else [],
                      before=first, after=best["check"], tries=tries, stopped=stopped,
                      started_from=list(base.layers) if base else [])
    return record, best["payload"]
