"""The examples users copy run end to end (each checks its own result and exits non-zero if wrong).

Each runs in a fresh process, most compiling a model: they start with the session, beside the
slow set's other subprocesses (conftest.py's `background_runs`), and each test checks its own
example's output."""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable

import pytest

pytestmark = pytest.mark.slow  # a fresh process each, most compiling a model

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
HF = importlib.util.find_spec("transformers") is not None

# test name: (script, arguments)
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
SECONDS = {  # roughly, each alone on a loaded 2-core machine: the longest start first
    "compiled_decode": 50,
    "mla_decode": 50,
    "hf_generate": 30,
    "tree_speculative": 30,
    "hf_mla_generate": 27,
    "disaggregated": 20,
    "checkpoint_resume": 14,
    "quickstart": 5,
}
Run = subprocess.CompletedProcess[str]


def _run(script: str, *args: str) -> Run:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], env=env, capture_output=True, text=True, timeout=600
    )


def background_jobs(items, request) -> list[tuple[str, float, Callable[[], Run]]]:
    """The selected tests' examples, for conftest's `background_runs`."""
    wanted = {item.callspec.params["example"] for item in items}
    if not HF:
        wanted -= NEEDS_HF
    return [
        (f"example {name}", seconds, functools.partial(_run, *RUNS[name]))
        for name, seconds in SECONDS.items()
        if name in wanted
    ]


@pytest.fixture
def output(background_runs, example) -> str:
    """The example's stdout, once it exited 0."""
    if example in NEEDS_HF and not HF:
        pytest.skip("needs transformers (the hf extra)")
    done = background_runs[f"example {example}"].result()
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
