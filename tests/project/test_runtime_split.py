"""The runtime's time split: what one call of the step's graph reads."""

from __future__ import annotations

import pytest

from benchmarks import runtime_split


def test_a_step_reads_its_weights_once_and_each_row_s_annotations_and_keys():
    read = runtime_split.step_bytes(weights=1000, rows=24, cells=49, features=2048, attention=512)
    assert read["weights"] == 1000
    assert read["annotations and keys"] == 24 * 4 * 49 * (2048 + 512)
    assert read["annotations and keys, once an image"] == 8 * 4 * 49 * (2048 + 512)  # 3 beams an image


def test_a_looked_up_table_is_not_read_whole():
    onnx = pytest.importorskip("onnx")
    import numpy as np
    from onnx import helper, numpy_helper

    table = numpy_helper.from_array(np.zeros((100, 8), np.float32), "embedding")
    weight = numpy_helper.from_array(np.zeros((8, 4), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embedding", "word"], ["e"]), helper.make_node("MatMul", ["e", "w"], ["y"])],
        "step", [helper.make_tensor_value_info("word", onnx.TensorProto.INT64, [None])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, 4])], [table, weight])
    assert runtime_split.weights_read(graph) == 8 * 4 * 4
