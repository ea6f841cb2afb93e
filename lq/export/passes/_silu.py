"""SiLU (``x * sigmoid(x)``) as onnxruntime's fused ``QuickGelu`` (com.microsoft, ``alpha=1``).

PyTorch's exporters write ``F.silu`` as ``Mul(x, Sigmoid(x))``. In a plain float file onnxruntime fuses that into
one ``QuickGelu`` kernel, but not where ``x`` is a DequantizeLinear's output (a SiLU between Q/DQ, what
:class:`lq.nn.QuantSiLU` exports): there the two ops stayed separate, two passes over a float tensor with a
stored intermediate. ``QuickGelu`` computes ``x * sigmoid(alpha * x)``: the same function. EfficientNet-style net
of ``bench.library``, batch 8, AVX-512 VNNI: its 31 SiLUs between Q/DQ took 0.32 ms of kernel time as QuickGelu,
0.80 ms as QLinearSigmoid + QLinearMul (the gate quantized too, as onnxruntime's own files do). On large maps
the integer form wins (:data:`lq.rules.onnxruntime.ORT_INT8_SILU_GATE_MIN_ELEMENTS`): those SiLUs are exported
gated and this pass leaves them alone (their Mul reads a DequantizeLinear, not the Sigmoid).
(``F.hardswish`` is exported as ONNX's ``HardSwish``, which onnxruntime runs as its HardSigmoid and Mul.)
"""

from __future__ import annotations

from lq.export._ir import Graph


def silus_as_quick_gelu(g: Graph) -> int:
    """Rewrite every ``Mul(x, Sigmoid(x))`` whose Sigmoid nothing else reads; returns how many."""
    prod, cons = g.producers(), g.consumers()
    done, dropped = 0, set()
    for mul in [n for n in g.nodes if n.op_type == "Mul" and len(n.input) == 2]:
        for x, s in (mul.input, mul.input[::-1]):
            sig = prod.get(s)
            if (sig is None or sig.op_type != "Sigmoid" or sig.input[0] != x or len(cons.get(s, [])) != 1
                    or s in g.graph_outputs):
                continue
            node = g.make_node("QuickGelu", [x], list(mul.output), hint=mul.name or "silu", like=mul,
                               domain=g.use_ms_domain(), alpha=1.0)
            g.nodes[g.nodes.index(mul)] = node
            dropped.add(id(sig))
            done += 1
            break
    g.nodes = [n for n in g.nodes if id(n) not in dropped]
    return done
