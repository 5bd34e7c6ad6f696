"""benchmarks/load_memory.py: what a folder's graphs hold in memory once loaded."""

from __future__ import annotations

import pytest

from benchmarks import load_memory


@pytest.mark.slow  # an ONNX export and a child process
def test_each_folder_is_loaded_in_a_process_of_its_own_and_its_memory_printed(tmp_path, onnx_registry_once,
                                                                                capsys):
    from captioner.io.export import export
    from tests.tiny import tiny_captioner

    folder = export(tiny_captioner(seed=5), tmp_path / "tiny", onnx=True).folder
    here = load_memory.load(folder)
    assert here["sessions"] == 2 and here["peak_mb"] >= here["held_mb"] > 0
    assert load_memory.main([str(folder)]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()
    assert header.split()[:2] == ["folder", "graphs"]
    name, graphs, peak, held = row.split()
    assert name == "tiny" and float(graphs) == here["graphs_mb"] and int(peak) >= int(held) > 0
