#!/usr/bin/env bash
# The transformers integration's tests on another transformers version, in a throwaway venv that sees
# this environment's packages (torch, the project) and installs only that transformers over them:
#
#     bash tests/other_transformers.sh 5.17.0 [pytest args...]
#
# Runs the family matrix (CI cells), speculative decoding, layer groups, the integration and its
# checkpoints. What an older transformers refuses by design is declared in tests/transformers_matrix.py
# (`Family.older`) and in the docs' "Supported models" table; those cells then expect the refusal.
# Checked versions: 5.5.4, 5.6.2, 5.7.0, 5.8.1, 5.9.0, 5.10.4, 5.11.0, 5.12.1, 5.13.1, 5.14.1, 5.15.1,
# 5.16.1, 5.17.0, 5.18.0, 5.19.0, 5.20.2, 5.21.1, 5.22.2, 5.23.0 (and the installed 5.24 by the ordinary
# test run).
set -euo pipefail
version="${1:?usage: bash tests/other_transformers.sh VERSION [pytest args...]}"
shift
cd "$(dirname "$0")/.."
venv="${TMPDIR:-/tmp}/torch_paged_kv_transformers_$version"
if [ ! -x "$venv/bin/python" ]; then
    python -m venv --system-site-packages "$venv"
    # transformers' own pins for the hub and tokenizers differ between versions: let pip pick them
    "$venv/bin/python" -m pip install -q "transformers==$version"
fi
"$venv/bin/python" -c "import transformers; assert transformers.__version__ == '$version', transformers.__version__"
PYTHONPATH="$PWD" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_model_families.py tests/test_speculative_hf.py tests/test_hf_groups.py \
    tests/test_transformers.py tests/test_transformers_checkpoint.py tests/test_hf_states.py \
    tests/test_hf_state_checkpoint.py tests/test_hf_indexed.py tests/test_hf_encoder_decoder.py \
    tests/test_hf_streamed_audio.py "$@"
