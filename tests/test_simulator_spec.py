"""The SGLang simulator's speculative decoding: lossless through a real draft-and-verify step,
SGLang's figures, what it refuses; a broken verify changes the output, so the equality checks
here and in the end-to-end tests can fail."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.simulator_support import simulator_starter  # noqa: F401  (the start fixture)

NEXTN = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")


PROMPTS = [[11 + i, 12, 13, 14] for i in range(24)]


def same_outputs(plain: Any, spec: Any, prompts: list[list[int]]) -> bool:
    """Whether the speculative server answers every prompt with the plain server's ids."""
    return all(plain.generate(p, max_new_tokens=4096)["output_ids"]
               == spec.generate(p, max_new_tokens=4096)["output_ids"] for p in prompts)


def test_speculative_decoding_is_lossless_with_sglangs_figures(start: Any) -> None:
    plain = start("--time-scale", "0.02")
    spec = start("--time-scale", "0.02", *NEXTN, "--accept-length", "2.5", "--enable-metrics")
    tokens = steps = 0
    assert same_outputs(plain, spec, PROMPTS), "speculation changed the output"
    for prompt in PROMPTS:
        b = spec.generate(prompt, max_new_tokens=4096)
        assert not [k for k in plain.generate(prompt, max_new_tokens=8)["meta_info"]
                    if k.startswith("spec_")]
        m = b["meta_info"]
        assert m["spec_accept_length"] == m["completion_tokens"] / m["spec_verify_ct"]
        assert m["spec_num_proposed_drafts"] == 3 * m["spec_verify_ct"]
        assert m["spec_accept_rate"] == m["spec_num_correct_drafts"] / (3 * m["spec_verify_ct"])
        assert sum(m["spec_correct_drafts_histogram"]) == m["spec_verify_ct"]
        assert spec.generate(prompt, max_new_tokens=4096)["meta_info"]["spec_verify_ct"] \
            == m["spec_verify_ct"], "the same request must draw the same acceptance"
        tokens, steps = tokens + m["completion_tokens"] - 1, steps + m["spec_verify_ct"]
    # Tokens per verify step (each reply's first token is its prefill's) near --accept-length.
    assert abs(tokens / steps - 2.5) / 2.5 < 0.1, tokens / steps
    info = spec.call("/get_server_info")[1]
    assert (info["speculative_algorithm"], info["speculative_num_draft_tokens"],
            info["max_running_requests"]) == ("EAGLE", 4, 48)   # SGLang's name, and its cap
    assert info["internal_states"][0]["avg_spec_accept_length"] > 1
    assert plain.call("/get_server_info")[1]["speculative_algorithm"] is None
    assert "sglang:spec_accept_length" in spec.call("/metrics")[1]


def test_a_broken_verify_changes_the_output(start: Any) -> None:
    """The verify commits every draft, wrong ones included: the equality check fails."""
    plain = start("--time-scale", "0.02")
    broken = start("--time-scale", "0.02", *NEXTN, "--accept-length", "2.5",
                   "--verify-fault", "accept-all")
    assert not same_outputs(plain, broken, PROMPTS[:6])
    first = broken.generate(PROMPTS[0], max_new_tokens=4096)
    right = plain.generate(PROMPTS[0], max_new_tokens=4096)
    assert len(first["output_ids"]) == len(right["output_ids"])   # same length, other tokens


@pytest.mark.parametrize("flags", [("--speculative-algorithm", "STANDALONE"),
                                   (*NEXTN[:6], "2"), (*NEXTN, "--accept-length", "5")])
def test_the_simulator_refuses_speculation_it_does_not_model(flags: tuple[str, ...]) -> None:
    result = subprocess.run([sys.executable, "-m", "embedded.simulator", "--port", "0", *flags],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "error:" in result.stderr, result.stderr
