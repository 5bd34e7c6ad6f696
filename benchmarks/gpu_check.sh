#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): every CUDA path once, then the benchmarks.
#   benchmarks/gpu_check.sh --out LOGS [--device cuda] [--tutorial PATH]    on a GPU machine
#   benchmarks/gpu_check.sh --out LOGS --device cpu --quick                 the same steps, tiny, on CPU
# It uses the Python it finds ($PYTHON, else python3) and installs nothing.
cd "$(dirname "$0")/.." && exec "${PYTHON:-python3}" -m benchmarks.gpu_check "$@"
