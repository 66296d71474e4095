"""`layercast bench mesh` counts a request SLO-compliant as LLM-Mesh does (eq. 1): token i within
TTFT_SLO + i * TPOT_SLO of sending; the stricter mean-TPOT reading is reported beside it."""

from benchmarks.bench_mesh import complies, complies_mean_tpot, slo_misses
from benchmarks.bench_trace import Outcome


def answered(chunk_s: list[float], prompt_tokens: int = 8) -> Outcome:
    o = Outcome(0, 0.0, 0.0, prompt_tokens, len(chunk_s), ok=True, tokens=len(chunk_s), chunks=len(chunk_s),
                chunk_s=list(chunk_s))
    o.ttft_s = chunk_s[0]
    o.tbt_s = (chunk_s[-1] - chunk_s[0]) / (len(chunk_s) - 1) if len(chunk_s) > 1 else None
    return o


def test_an_early_first_token_buys_slack_for_the_later_ones_as_the_headroom_does():
    # TTFT SLO 1 s, TPOT 0.1 s: deadlines 1.0, 1.1, 1.2, 1.3. First at 0.1, then every 0.3 s.
    o = answered([0.1, 0.4, 0.7, 1.0])
    assert complies(o, 1.0, 0.1)
    assert not complies_mean_tpot(o, 1.0, 0.1)  # mean gap 0.3 s > 0.1 s
    assert slo_misses([o], 1.0, 0.1) == {"first_token": 0, "later_token": 0, "mean_tpot": 1}


def test_any_token_past_its_deadline_breaks_the_slo():
    assert not complies(answered([0.1, 0.4, 1.25, 1.26]), 1.0, 0.1)  # token 2 due by 1.2
    assert not complies(answered([1.01, 1.02]), 1.0, 0.1)  # the first token late
    assert slo_misses([answered([0.1, 0.4, 1.25, 1.26]), answered([1.01, 1.02])], 1.0, 0.1) == {
        "first_token": 1, "later_token": 1, "mean_tpot": 1}


def test_without_a_deployment_ttft_slo_the_papers_grows_with_the_prompt():
    # max(2, L/512): 2 s for 8 tokens, 4 s for 2048
    assert complies(answered([1.9]), None, 0.1) and not complies(answered([2.1]), None, 0.1)
    assert complies(answered([3.9], prompt_tokens=2048), None, 0.1)


def test_a_failed_request_never_complies():
    o = answered([0.1, 0.2])
    o.ok, o.error = False, "timed out after 60s"
    assert not complies(o, 1.0, 0.1) and not complies_mean_tpot(o, 1.0, 0.1)
