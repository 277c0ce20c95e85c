"""The examples users copy run end to end (each checks its own result and exits non-zero if wrong)."""

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a fresh process each, most compiling a model

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_compiled_decode_serves_requests_without_recompiling():
    out = _run("compiled_decode.py", "--requests", "4", "--new-tokens", "10", "--device", "cpu")
    assert "all 4 requests match an uncached recomputation" in out


def test_checkpoint_resume_continues_identically_in_a_new_process():
    out = _run("checkpoint_resume.py", "--device", "cpu")
    assert out.strip().splitlines()[-1].startswith("identical")


def test_mla_decode_serves_requests_from_a_latent_cache_without_recompiling():
    out = _run("mla_decode.py", "--requests", "3", "--new-tokens", "6", "--device", "cpu")
    assert "all 3 requests match an uncached non-absorbed recomputation" in out


def test_disaggregated_prefill_and_decode_processes_give_the_single_process_tokens():
    out = _run("disaggregated.py", "--requests", "4", "--new-tokens", "6", "--device", "cpu", "--eager")
    assert "identical to a single-process run: 4 requests" in out
    assert "received requests [2, 3] (4 of 5 pages sent)" in out  # the shared system prompt's page stayed


def test_hf_mla_generate_matches_dynamic_cache_in_both_attention_modes():
    out = _run("hf_mla_generate.py", "--batch", "2", "--new-tokens", "8")
    assert "PagedCache + sdpa    : 2 rows x 8 tokens, identical to DynamicCache" in out
    assert "PagedCache + paged_kv: 2 rows x 8 tokens, identical to DynamicCache" in out
    assert "PagedCache float32 (latent + rope row)" in out


def test_tree_speculative_decoding_gives_plain_greedy_tokens():
    out = _run("tree_speculative.py", "--new-tokens", "24", "--device", "cpu")
    assert "identical to plain greedy decoding: 2 sequences x 24 tokens" in out
    rate = float(out.split("acceptance rate: ")[1].split()[0])
    assert 0 < rate < 1  # some drafts kept, some rejected: both paths of accept ran
