"""lib.testep against DeepEP's own test_ep.py output from two H200s and the published JSON."""

import json
import re
from pathlib import Path

import pytest

from lib.measure.testep import (PHASES, as_published_shape, first_case, parse_test_ep_log,
                        parse_test_ep_text, read_published_microbench)

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
LOGS = FIXTURES / "deepep-test_ep-2xh200"
PUBLISHED = (FIXTURES / "public-repro" / "results" / "vllm-deepep-dropin-20260706" / "vllm"
             / "t2_ep16_2node_test_ep_microbench.json")


def log(tokens: int) -> Path:
    path = LOGS / f"test_ep_{tokens}tok_h7168_top8_e256.log"
    # Missing evidence must fail the suite, never skip it.
    assert path.is_file(), f"fixture missing: {path}"
    return path


# TOOLCHAIN.md "DeepEP V2 itself on two H200s": first case, per rank (us).
TOOLCHAIN_TABLE = {
    128: {"dispatch": 14.8, "cached dispatch": 11.4, "combine": 14.4, "reduced combine": 30.0},
    512: {"dispatch": 22.3, "cached dispatch": 20.9, "combine": 33.3, "reduced combine": 48.1},
    4096: {"dispatch": 106.2, "cached dispatch": 105.3, "combine": 192.2, "reduced combine": 233.2},
}


@pytest.mark.parametrize("tokens", sorted(TOOLCHAIN_TABLE))
def test_first_case_matches_toolchain_table(tokens):
    case = first_case(parse_test_ep_log(log(tokens)))
    assert case["num_tokens"] == tokens
    assert case["num_ranks"] == 2
    for phase, published in TOOLCHAIN_TABLE[tokens].items():
        assert round(case["phases_us"][phase]["p50"], 1) == published
    assert case["missing_phases"] == []


def test_phase_statistics_across_ranks():
    case = first_case(parse_test_ep_log(log(128)))
    dispatch = case["phases_us"]["dispatch"]
    # Rank lines in the log: 14.794 and 14.758 us.
    assert dispatch == {"n": 2, "p50": pytest.approx(14.776), "mean": pytest.approx(14.776),
                        "min": 14.758, "max": 14.794}
    assert case["dc_p50_us"] == pytest.approx(dispatch["p50"] + case["phases_us"]["combine"]["p50"])
    assert case["params"]["use_fp8_dispatch"] == 1 and case["hidden"] == 7168
    assert (case["num_topk"], case["num_experts"]) == (8, 256)


def test_result_has_the_published_json_shape():
    published = read_published_microbench(PUBLISHED)
    ours = as_published_shape(first_case(parse_test_ep_log(log(128))))
    assert set(ours) == {"phases_us", "dc_p50_us"}
    assert set(ours["phases_us"]) == set(published["phases_us"]) == set(PHASES)
    for phase, stats in ours["phases_us"].items():
        assert set(stats) == set(published["phases_us"][phase])


def test_published_microbench_dc_p50():
    published = read_published_microbench(PUBLISHED)
    assert published["dc_p50_us"] == 443.6
    phases = published["phases_us"]
    assert phases["dispatch"]["p50"] == 185.4 and phases["combine"]["p50"] == 258.2
    assert round(phases["dispatch"]["p50"] + phases["combine"]["p50"], 1) == published["dc_p50_us"]
    assert phases["dispatch"]["n"] == 16


def test_rank_prefixes_are_ignored():
    text = log(512).read_text()
    prefixed = "\n".join(f"[rank{i % 2}]: {line}" for i, line in enumerate(text.splitlines()))
    plain = first_case(parse_test_ep_text(text))
    assert first_case(parse_test_ep_text(prefixed))["phases_us"] == plain["phases_us"]


def test_several_cases_in_one_log_keyed_by_case():
    text = log(128).read_text() + log(4096).read_text()
    cases = parse_test_ep_text(text)
    assert len(cases) == 2
    assert [c["num_tokens"] for c in cases.values()] == [128, 4096]
    assert all(key.startswith(f"tokens={c['num_tokens']} | do_handle_copy=1")
               for key, c in cases.items())
    assert first_case(cases)["num_tokens"] == 128
    alone = first_case(parse_test_ep_log(log(4096)))
    assert list(cases.values())[1]["dc_p50_us"] == alone["dc_p50_us"]


def renumber_ranks(text: str, offset: int, num_ranks: int) -> str:
    return re.sub(r"EP:\s*(\d+)/\d+",
                  lambda m: f"EP: {int(m.group(1)) + offset:3}/{num_ranks}", text)


def test_two_nodes_concatenated_merge_into_one_case():
    # Two copies of a real 2-rank log, renumbered as ranks 0-1 and 2-3 of a 4-rank run.
    text = log(128).read_text()
    merged = parse_test_ep_text(renumber_ranks(text, 0, 4) + renumber_ranks(text, 2, 4))
    assert len(merged) == 1
    case = first_case(merged)
    assert case["num_ranks"] == 4 and case["phases_us"]["dispatch"]["n"] == 4


def test_same_configuration_repeated_opens_a_new_case():
    # Pressure tests rerun the same configuration on the same ranks.
    text = log(128).read_text()
    cases = parse_test_ep_text(text + text)
    assert len(cases) == 2
    assert list(cases)[1].endswith("[repeat 2]")


def test_log_without_phase_lines_names_the_file():
    other = FIXTURES / "aiperf-0.13" / "sweep-c1-c2-c4" / "logs" / "aiperf.log"
    assert other.is_file(), f"fixture missing: {other}"
    with pytest.raises(ValueError, match=re.escape(str(other))) as error:
        parse_test_ep_log(other)
    assert "dispatch" in str(error.value)


def test_missing_combine_leaves_dc_undefined():
    text = "\n".join(line for line in log(128).read_text().splitlines()
                     if "| combine:" not in line)
    case = first_case(parse_test_ep_text(text))
    assert case["dc_p50_us"] is None and case["missing_phases"] == ["combine"]


def test_published_reader_names_missing_keys(tmp_path):
    document = json.loads(PUBLISHED.read_text())
    del document["phases_us"]["combine"]
    broken = tmp_path / "t2.json"
    broken.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="combine"):
        read_published_microbench(broken)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        read_published_microbench(tmp_path / "nope.json")
