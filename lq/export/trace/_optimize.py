"""The current exporter's graph clean-up, at a cost that grows with the graph, not with its square.

``torch.onnx.export(dynamo=True)`` ends by optimizing the graph it wrote with onnxscript's optimizer: functions
inlined, constants folded, a table of pattern rewrites (no-op casts and reshapes, successive clips, BatchNorm into
Conv ...), unused nodes, functions and opsets removed, common subexpressions merged, names fixed, then its fusions.
Every rewrite but one matches a pattern that ends in one node, tried at each node. The exception, ``SlicesSplit``
(two Slices of one tensor become one Split), ends in two: onnxscript's matcher tries it by pairing every Slice
with every node of the graph of the right type, so its cost grows with the square of the graph. On a stack of 48
pre-norm transformer layers (6,400 nodes) the optimizer took 11 of the export's 35 seconds, on 16 layers 1.5 of 10
(Intel Xeon, AMX).

lq asks the exporter not to optimize and runs the same passes itself (:func:`optimize`), with every rewrite whose
pattern ends in one node: the same graph, except that two Slices of one tensor stay two Slices (onnxruntime and
the other runtimes run them as fast as the Split; lq's passes read either). Where this onnxscript does not have
the pieces named here, the exporter's own optimizer runs, as before.
"""

from __future__ import annotations

import functools
import logging

__all__ = ["optimize", "optimize_model", "single_output_rules"]

_log = logging.getLogger("lq")


def _ends_in_one_node(rule) -> bool:
    pattern = getattr(rule, "_target_pattern", None)
    return bool(getattr(pattern, "has_single_output_node", True))


@functools.cache
def single_output_rules() -> tuple | None:
    """onnxscript's default rewrites whose pattern ends in one node (None where this onnxscript has no such
    table)."""
    try:
        from onnxscript import rewriter
    except ImportError:
        return None
    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if rules is None:
        return None
    return tuple(r for r in rules if _ends_in_one_node(r))


def _passes(rules):
    """The optimizer's passes in its order (functions inlined first; folding, rewrites and removal of what they
    left unused twice, stopping early when nothing changed; then the one-off tidy-ups), with ``rules``."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript import rewriter
    from onnxscript.optimizer import _constant_folding

    fold_and_rewrite = ir.passes.PassManager(
        [_constant_folding.FoldConstantsPass(
            shape_inference=True,
            input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
            output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
            should_fold=lambda node: None),
         rewriter.RewritePass(rules),
         common.RemoveUnusedNodesPass(),
         common.RemoveUnusedFunctionsPass(),
         common.RemoveUnusedOpsetsPass()],
        steps=2, early_stop=True)
    return ir.passes.Sequential(
        common.InlinePass(),
        fold_and_rewrite,
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )


def optimize(program) -> None:
    """Optimize the ``ONNXProgram`` ``program`` (exported with ``optimize=False``) in place, as the exporter would
    have, without its quadratic rewrite."""
    if not optimize_model(program.model):  # another onnxscript: its own optimizer, as before
        program.optimize()


def optimize_model(model) -> bool:
    """Optimize the ``onnx_ir`` model ``model`` in place; False (nothing done) where this onnxscript lacks the
    pieces."""
    rules = single_output_rules()
    if rules is None:
        return False
    try:
        steps = _passes(rules)
        from onnxscript.rewriter import onnx_fusions
    except (ImportError, AttributeError, TypeError) as e:
        _log.debug("lq: the exporter's own graph optimizer runs (%s)", e)
        return False
    steps(model)
    onnx_fusions.fuse(model)
    return True
