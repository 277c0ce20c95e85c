"""The examples users copy run end to end (each checks its own result and exits non-zero if wrong).

Each runs in a fresh process, most compiling a model: the module starts the selected tests' examples
at once, as many at a time as there are cores (the compiles are mostly one thread each), and each
test checks its own example's output."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a fresh process each, most compiling a model

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
HF = importlib.util.find_spec("transformers") is not None

# test name: (script, arguments), the longest first (started first, so that the last to start are short)
RUNS = {
    "compiled_decode": ("compiled_decode.py", "--requests", "4", "--new-tokens", "10", "--device", "cpu"),
    "mla_decode": ("mla_decode.py", "--requests", "3", "--new-tokens", "6", "--device", "cpu"),
    "hf_generate": ("hf_generate.py", "--new-tokens", "8", "--batch", "2", "--repeats", "1"),
    "tree_speculative": ("tree_speculative.py", "--new-tokens", "24", "--device", "cpu"),
    "hf_mla_generate": ("hf_mla_generate.py", "--batch", "2", "--new-tokens", "8"),
    "disaggregated": ("disaggregated.py", "--requests", "4", "--new-tokens", "6", "--device", "cpu", "--eager"),
    "checkpoint_resume": ("checkpoint_resume.py", "--device", "cpu"),
    "quickstart": ("quickstart.py",),
}
NEEDS_HF = {"hf_generate", "hf_mla_generate"}


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def started(request) -> dict[str, concurrent.futures.Future[subprocess.CompletedProcess[str]]]:
    """name -> the running example, for the examples this session's selected tests check."""
    wanted = {item.callspec.params["example"] for item in request.session.items if item.module is request.module}
    if not HF:
        wanted -= NEEDS_HF
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=cores)
    yield {name: pool.submit(_run, *RUNS[name]) for name in RUNS if name in wanted}
    pool.shutdown(cancel_futures=True)


@pytest.fixture
def output(started, example) -> str:
    """The example's stdout, once it exited 0."""
    if example in NEEDS_HF and not HF:
        pytest.skip("needs transformers (the hf extra)")
    done = started[example].result()
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("example", ["compiled_decode"])
def test_compiled_decode_serves_requests_without_recompiling(output):
    assert "all 4 requests match an uncached recomputation" in output


@pytest.mark.parametrize("example", ["checkpoint_resume"])
def test_checkpoint_resume_continues_identically_in_a_new_process(output):
    assert output.strip().splitlines()[-1].startswith("identical")


@pytest.mark.parametrize("example", ["mla_decode"])
def test_mla_decode_serves_requests_from_a_latent_cache_without_recompiling(output):
    assert "all 3 requests match an uncached non-absorbed recomputation" in output


@pytest.mark.parametrize("example", ["disaggregated"])
def test_disaggregated_prefill_and_decode_processes_give_the_single_process_tokens(output):
    assert "identical to a single-process run: 4 requests" in output
    assert "received requests [2, 3] (4 of 5 pages sent)" in output  # the shared system prompt's page stayed


@pytest.mark.parametrize("example", ["hf_mla_generate"])
def test_hf_mla_generate_matches_dynamic_cache_in_both_attention_modes(output):
    assert "PagedCache + sdpa    : 2 rows x 8 tokens, identical to DynamicCache" in output
    assert "PagedCache + paged_kv: 2 rows x 8 tokens, identical to DynamicCache" in output
    assert "PagedCache float32 (latent + rope row)" in output


@pytest.mark.parametrize("example", ["tree_speculative"])
def test_tree_speculative_decoding_gives_plain_greedy_tokens(output):
    assert "identical to plain greedy decoding: 2 sequences x 24 tokens" in output
    rate = float(output.split("acceptance rate: ")[1].split()[0])
    assert 0 < rate < 1  # some drafts kept, some rejected: both paths of accept ran


@pytest.mark.parametrize("example", ["hf_generate"])
def test_hf_generate_matches_dynamic_cache(output):
    assert "identical to DynamicCache: yes" in output


@pytest.mark.parametrize("example", ["quickstart"])
def test_quickstart_matches_sdpa(output):
    assert "matches SDPA" in output
