#!/usr/bin/env bash
# Builds the side virtualenv holding the real speculators 0.9.0, against which
# tests/test_speculators_interop.py checks the heads spark_generate saves, and prints its python:
#
#   export SPARK_SPECULATORS_PYTHON="$(tests/interop/build_speculators_venv.sh)"
#
# Usage: build_speculators_venv.sh [DIR]  (default: $SPARK_GENERATE_CACHE or ~/.cache/spark_generate,
# then speculators-venv). An environment that already imports speculators' DSpark model is reused.
# speculators 0.9.0 needs transformers <= 5.19, hence a separate environment; it imports openai,
# datasets and hs-connectors at module level, and loguru while loading a folder.
set -euo pipefail
dir="${1:-${SPARK_GENERATE_CACHE:-$HOME/.cache/spark_generate}/speculators-venv}"
if ! "$dir/bin/python" -c "import speculators.models.dspark" >/dev/null 2>&1; then
    rm -rf "$dir"
    python3 -m venv "$dir"
    {
        "$dir/bin/pip" install -q torch==2.13.0
        "$dir/bin/pip" install -q transformers==5.19.0
        "$dir/bin/pip" install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
        "$dir/bin/pip" install -q openai==3.57.0 datasets==5.1.0 loguru==0.7.3
    } >&2
fi
echo "$dir/bin/python"
