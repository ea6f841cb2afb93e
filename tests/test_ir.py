"""The export's graph wrapper (:class:`lq.export._ir.Graph`): node lookups by identity, fresh names, renames, each
at a cost that grows with the graph, not with its square. Checked against the plain algorithms written out here."""

from __future__ import annotations

import random

import onnx
from onnx import helper

from lq.export._ir import Graph


def _model(names: list[str]) -> onnx.ModelProto:
    nodes = [helper.make_node("Identity", ["x"], [n]) for n in names]
    nodes += [helper.make_node("Relu", ["x"], ["same"]), helper.make_node("Relu", ["x"], ["same"])]  # equal by value
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("same", onnx.TensorProto.FLOAT, [1])])
    return helper.make_model(g)


def test_nodes_are_found_and_removed_by_identity_not_by_value():
    g = Graph(_model(["a", "b"]))
    first, second = g.nodes[2], g.nodes[3]
    assert first == second and first is not second  # protobuf equality: list.index would find the first
    assert g.nodes.index(second) == 3 and g.nodes.index(first) == 2 and g.nodes.index(g.nodes[0]) == 0
    g.nodes.remove(second)
    assert len(g.nodes) == 3 and g.nodes[2] is first
    g.nodes = [n for n in g.nodes if n is not first]  # a plain list assigned back keeps the lookup
    assert g.nodes.index(g.nodes[1]) == 1


def test_fresh_names_are_the_first_free_ones_as_a_plain_search_gives():
    rng = random.Random(0)
    taken = ["w", "w_2", "w_3", "bias_1", "q"]
    g = Graph(_model(taken))
    used = set(g._used_names)
    for _ in range(300):
        hint = rng.choice(["w", "bias", "q", "q_out", "scale"])
        name, i = hint, 0
        while name in used:  # the reference: probe from the bare name up
            i += 1
            name = f"{hint}_{i}"
        used.add(name)
        assert g.fresh(hint) == name


def test_a_rename_reaches_every_reader_or_the_given_ones():
    m = _model(["a"])
    m.graph.node.append(helper.make_node("Add", ["a", "a"], ["c"]))
    m.graph.node.append(helper.make_node("Neg", ["a"], ["d"]))
    g = Graph(m)
    g.replace_uses("a", "x")
    assert [list(n.input) for n in g.nodes[-2:]] == [["x", "x"], ["x"]]
    g.replace_uses("x", "y", readers=[g.nodes[-1]])
    assert [list(n.input) for n in g.nodes[-2:]] == [["x", "x"], ["y"]]
