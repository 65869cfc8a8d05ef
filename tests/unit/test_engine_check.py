"""The engine check's arithmetic on vLLM's spec-decode counters, its comparison with the tau pass's traces, its
settings and its config checks (vLLM itself runs on the GPU: benchmarks/device_run.sh)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_pipeline import engine_comparison, workflow_config
from eagle3_pipeline.config_schema import ConfigError, schema_defaults
from eagle3_pipeline.formats import engine_check as engine_check_format
from eagle3_pipeline.runtime.serving import vllm_offline
from eagle3_pipeline.runtime.traces import Trace
from eagle3_pipeline.settings import from_section
from eagle3_pipeline.stages import engine_check


def metric(name: str, value=None, values=None, engine: str = "0") -> SimpleNamespace:
    return SimpleNamespace(name=name, labels={"engine": engine}, value=value, values=values)


def snapshot(drafts: int, draft_tokens: int, accepted: int, per_position: list[int], engine: str = "0") -> list:
    return [metric("vllm:spec_decode_num_drafts", drafts, engine=engine),
            metric("vllm:spec_decode_num_draft_tokens", draft_tokens, engine=engine),
            metric("vllm:spec_decode_num_accepted_tokens", accepted, engine=engine),
            metric(vllm_offline.PER_POSITION, values=per_position, engine=engine),
            metric("vllm:num_requests_running", 1.0, engine=engine)]  # a gauge: not a spec-decode counter


def test_counters_sum_over_engines_and_a_set_counts_only_its_own_increase():
    before = vllm_offline.counters(snapshot(10, 40, 12, [6, 4, 2, 0]))
    after = vllm_offline.counters(snapshot(30, 120, 40, [18, 12, 7, 3]) + snapshot(5, 20, 5, [3, 1, 1, 0], "1"))
    assert after == {"drafts": 35, "draft_tokens": 140, "accepted_tokens": 45, "accepted_per_position": [21, 13, 8, 3]}
    assert vllm_offline.increase(after, before) == {"drafts": 25, "draft_tokens": 100, "accepted_tokens": 33,
                                                    "accepted_per_position": [15, 9, 6, 3]}


def test_engine_figures_are_vllms_acceptance_length_and_conditional_acceptance_by_position():
    figures = engine_comparison.engine_figures({"drafts": 10, "draft_tokens": 40, "accepted_tokens": 12,
                                           "accepted_per_position": [6, 4, 2, 0]})
    assert figures["engine_acceptance_length"] == pytest.approx(2.2)
    assert figures["engine_acceptance_by_position"] == pytest.approx([0.6, 4 / 6, 0.5, 0.0])


def trace(prompt_id: str, method: str, tokens: list[int], accepted: list[int], k: int = 4) -> Trace:
    return Trace(prompt_id, method, tokens, accepted=accepted, drafted=[k] * len(accepted),
                 target_forwards=len(accepted))


def evaluated(traces: list[Trace]) -> dict:
    return {"summary": {}, "traces": [asdict(t) | {"tau": t.tau} for t in traces]}


def test_the_evaluators_traces_in_vllms_arithmetic():
    traces = [trace("a", "eagle3@k=4", list(range(9)), [2, 0, 4]), trace("b", "eagle3@k=4", [1, 2], [1])]
    figures = engine_comparison.evaluator_figures(traces, 4)
    assert figures["evaluator_acceptance_length"] == pytest.approx(1 + 7 / 4)
    assert figures["evaluator_acceptance_by_position"][0] == pytest.approx(3 / 4)  # steps with draft 1 accepted


def engine_run(k: int | None, counters: dict | None, tokens: dict[str, list[int]], seconds: float = 1.0) -> dict:
    run = {"seconds": seconds, "tokens": tokens, "output_tokens": sum(map(len, tokens.values()))}
    return {"draft_length": k, "start_seconds": 30.0, "vllm_version": "0.26.0",
            "sets": {"mtbench": run | ({"counters": counters} if counters else {})}}


RECORDED = Path(__file__).resolve().parents[1] / "data" / "engine_check" / "h200-vllm-0.26.0.json.gz"
RECORDED_BF16 = RECORDED.with_name("h200-vllm-0.26.0-bf16.json.gz")
SETTINGS = from_section(engine_check.Settings, schema_defaults("engine_check"), trust_remote_code=False)


def check_of(engine_counters: dict, spec_tokens: dict[str, list[int]]) -> dict:
    ours = [trace("a", "target", [5, 6, 7, 8], []), trace("b", "target", [9, 9], []),
            trace("a", "eagle3@k=4", [5, 6, 7, 8], [2, 0]), trace("b", "eagle3@k=4", [9, 9], [1])]
    engines = {"target": engine_run(None, None, {"a": [5, 6, 7, 8], "b": [9, 9]}, seconds=2.0),
               "eagle3@k=4": engine_run(4, engine_counters, spec_tokens)}
    return engine_comparison.compare({"mtbench": ["a", "b"]}, engines, {"mtbench": evaluated(ours)},
                                     SETTINGS.tolerance)


def test_the_engine_agreeing_with_the_evaluator_passes_with_its_speed_beside_the_target_alone():
    result = check_of({"drafts": 3, "draft_tokens": 12, "accepted_tokens": 3, "accepted_per_position": [2, 1, 0, 0]},
                      {"a": [5, 6, 7, 8], "b": [9, 9]})
    figures = result["sets"]["mtbench"]["methods"]["eagle3@k=4"]
    assert result["passed"] and not result["failures"] and figures["passed"]
    assert figures["engine_acceptance_length"] == figures["evaluator_acceptance_length"] == pytest.approx(2.0)
    assert figures["identical_share"] == 1.0 and figures["speedup_vs_target"] == pytest.approx(2.0)
    assert result["sets"]["mtbench"]["target_matches_evaluator_share"] == 1.0
    assert result["start_seconds"] == {"target": 30.0, "eagle3@k=4": 30.0} and result["engine_version"] == "0.26.0"


def test_a_gap_above_the_tolerance_fails_naming_the_likely_causes_and_divergence_is_counted():
    result = check_of({"drafts": 4, "draft_tokens": 16, "accepted_tokens": 2, "accepted_per_position": [2, 0, 0, 0]},
                      {"a": [5, 6, 0, 8], "b": [9, 9]})
    figures = result["sets"]["mtbench"]["methods"]["eagle3@k=4"]
    assert not result["passed"] and figures["gap"] == pytest.approx(1.5 / 2.0 - 1)
    (failure,) = result["failures"]
    assert failure.startswith("mtbench, eagle3@k=4: engine acceptance length 1.500 vs the evaluator's 2.000 on all "
                              "2 prompts (no per-prompt counters) (-25.0%")
    assert "aux layer ids" in failure and "d2t" in failure and "positions" in failure and "norms" in failure
    assert figures["identical_share"] == 0.5 and figures["first_divergence"] == {"a": 2}


def test_result_files_are_validated(tmp_path):
    path = tmp_path / "vllm.json"
    result = check_of({"drafts": 3, "draft_tokens": 12, "accepted_tokens": 3, "accepted_per_position": [2, 1, 0, 0]},
                      {"a": [5, 6, 7, 8], "b": [9, 9]})
    engine_check_format.write(path, result)
    assert engine_check_format.read(path) == json.loads(json.dumps(result))
    path.write_text(path.read_text()[:100])
    with pytest.raises(engine_check_format.InvalidEngineCheck, match="vllm.json: unreadable"):
        engine_check_format.read(path)


def test_engine_arguments_serve_the_drafter_as_eagle3_with_graphs_unless_told_eager():
    job = {"target_dir": "results/r/target", "serving_dir": "results/r/serving/drafter", "dtype": "bfloat16",
           "cuda_graphs": True, "gpu_memory_utilization": 0.5, "max_model_len": 1024, "trust_remote_code": False,
           "draft_length": 4}
    arguments = vllm_offline.engine_arguments(job)
    assert arguments["speculative_config"] == {"method": "eagle3", "model": "results/r/serving/drafter",
                                               "num_speculative_tokens": 4}
    assert arguments["enforce_eager"] is False and arguments["max_num_seqs"] == 1
    assert arguments["disable_log_stats"] is False and arguments["generation_config"] == "vllm"
    alone = vllm_offline.engine_arguments(job | {"draft_length": None, "cuda_graphs": False})
    assert "speculative_config" not in alone and alone["enforce_eager"] is True


def test_the_serve_command_is_one_shell_line():
    assert engine_check.serve_command(Path("results/r/target"), Path("results/r/serving/drafter"), 4) == (
        "vllm serve results/r/target --speculative-config '{\"method\": \"eagle3\", \"model\": "
        "\"results/r/serving/drafter\", \"num_speculative_tokens\": 4}'")


def test_config_checks_name_the_key():
    config = {"evaluate": {"draft_lengths": [4, 7]}, "engine_check": {"enabled": False, "draft_lengths": [5]}}
    with pytest.raises(ConfigError, match=r"engine_check\.draft_lengths: \[5\] are not among evaluate"):
        workflow_config.check_engine_check(config, [])
    with pytest.raises(ConfigError, match=r"engine_check\.prompts: \['humaneval'\] are not prompt sets"):
        workflow_config.chosen_sets({"engine_check": {"prompts": ["humaneval"]}}, "engine_check.prompts",
                                    ["mtbench-package"])
    assert workflow_config.chosen_sets({"engine_check": {"prompts": None}}, "engine_check.prompts", ["a", "b"]) == [
        "a", "b"]


def test_without_vllm_an_enabled_check_is_warned_before_the_run(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    warnings: list[str] = []
    workflow_config.check_engine_check({"evaluate": {"draft_lengths": [4]}, "engine_check": {"enabled": True}},
                                       warnings)
    assert warnings and "vllm package is not installed" in warnings[0]


def test_on_recorded_h200_counters_the_figures_and_the_verdict_come_out_as_the_run_logged_them():
    # vLLM 0.26.0, bf16, CUDA graphs, against an fp32 tau pass: 34-48 % of the texts agree; this run kept only the
    # counters of whole sets, so the verdict rests on every prompt
    recorded = json.loads(gzip.decompress(RECORDED.read_bytes()))
    engines, evaluations = recorded["engines"], recorded["evaluations"]
    prompt_ids = {name: list(run["tokens"]) for name, run in engines["target"]["sets"].items()}
    result = engine_comparison.compare(prompt_ids, engines, evaluations, 0.03)
    logged = {"mtbench-package": (1.762, 1.720, 0.375), "held-out": (1.918, 1.824, 0.3375),
              "humaneval-package": (2.222, 2.177, 0.475)}
    for name, (engine, ours, same_share) in logged.items():
        figures = result["sets"][name]["methods"]["eagle3@k=4"]
        assert round(figures["engine_acceptance_length"], 3) == engine
        assert round(figures["evaluator_acceptance_length"], 3) == ours
        assert figures["identical_share"] == 1.0 and figures["judged_on"].startswith("all 80 prompts")
        assert result["sets"][name]["target_matches_evaluator_share"] == same_share
    assert [f.split(",")[0] for f in result["failures"]] == ["held-out"]  # +5.2 %, on different texts
    assert result["engine_version"] == "0.26.0"


def test_on_recorded_h200_counters_per_prompt_against_a_bf16_tau_pass_the_check_passes_as_logged():
    # the same engine against the evaluator in its own precision, per-prompt counters kept: the verdict rests on the
    # 20 / 34 / 42 prompts whose text vLLM (with and without the drafter) and the evaluator agree on
    recorded = json.loads(gzip.decompress(RECORDED_BF16.read_bytes()))
    engines, evaluations = recorded["engines"], recorded["evaluations"]
    prompt_ids = {name: list(run["tokens"]) for name, run in engines["target"]["sets"].items()}
    result = engine_comparison.compare(prompt_ids, engines, evaluations, 0.03)
    logged = {"mtbench-package": (1.766, 1.768, 20, 1.705, 1.695), "held-out": (1.857, 1.853, 34, 1.830, 1.803),
              "humaneval-package": (2.135, 2.095, 42, 2.093, 2.050)}
    for name, (engine, ours, same_text, engine_all, ours_all) in logged.items():
        figures = result["sets"][name]["methods"]["eagle3@k=4"]
        assert round(figures["engine_acceptance_length"], 3) == engine
        assert round(figures["evaluator_acceptance_length"], 3) == ours
        assert figures["judged_on"] == f"{same_text} same-text prompts"
        assert round(figures["engine_acceptance_length_all"], 3) == engine_all
        assert round(figures["evaluator_acceptance_length_all"], 3) == ours_all
        assert figures["identical_share"] == 1.0 and figures["passed"]
    assert result["passed"] and result["failures"] == []


def same_text_case(engine_on_different_text: int) -> dict:
    """12 prompts on which engine and evaluator agree (drafts accepted: 2 per step in both) and one whose text
    differs, on which the engine accepts `engine_on_different_text` per step."""
    ids = [f"p{i}" for i in range(13)]
    ours = [trace(pid, "target", [1, 2, 3], []) for pid in ids[:12]] + [trace("p12", "target", [7, 7, 7], [])]
    ours += [trace(pid, "eagle3@k=4", [1, 2, 3] if pid != "p12" else [7, 7, 7], [2]) for pid in ids]
    per_prompt = {pid: {"drafts": 1, "draft_tokens": 4, "accepted_tokens": 2, "accepted_per_position": [1, 1, 0, 0]}
                  for pid in ids[:12]}
    per_prompt["p12"] = {"drafts": 1, "draft_tokens": 4, "accepted_tokens": engine_on_different_text,
                         "accepted_per_position": [1] * engine_on_different_text + [0] * (4 - engine_on_different_text)}
    tokens = {pid: [1, 2, 3] for pid in ids}
    spec = engine_run(4, engine_comparison.summed(list(per_prompt.values())), tokens)
    spec["sets"]["mtbench"]["per_prompt"] = per_prompt
    engines = {"target": engine_run(None, None, tokens), "eagle3@k=4": spec}
    return engine_comparison.compare({"mtbench": ids}, engines, {"mtbench": evaluated(ours)}, 0.03)


def test_the_verdict_rests_on_the_prompts_whose_text_both_decoders_agree_on():
    result = same_text_case(engine_on_different_text=4)
    figures = result["sets"]["mtbench"]["methods"]["eagle3@k=4"]
    assert result["passed"] and figures["judged_on"] == "12 same-text prompts" and figures["gap"] == 0
    assert figures["engine_acceptance_length_all"] == pytest.approx(1 + 28 / 13)  # p12's text is another one
    assert figures["evaluator_acceptance_length_all"] == pytest.approx(3.0)


def test_with_few_same_text_prompts_the_verdict_rests_on_every_prompt(monkeypatch):
    monkeypatch.setattr(engine_comparison, "MIN_SAME_TEXT", 13)
    figures = same_text_case(engine_on_different_text=4)["sets"]["mtbench"]["methods"]["eagle3@k=4"]
    assert figures["judged_on"] == "all 13 prompts (only 12 same-text prompts)"
    assert figures["engine_acceptance_length"] == figures["engine_acceptance_length_all"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_engine_process_fails_naming_the_package(tmp_path):
    import logging

    job = {"target_dir": str(tmp_path), "serving_dir": str(tmp_path), "dtype": "bfloat16", "cuda_graphs": True,
           "gpu_memory_utilization": 0.5, "max_model_len": 64, "max_new_tokens": 4, "trust_remote_code": False,
           "draft_length": 4, "sets": {"s": [{"prompt_id": "0", "ids": [1, 2]}]}}
    (tmp_path / "target-0.json").write_text("{}")  # another fingerprint's result: dropped
    with pytest.raises(Exception, match="engine_check needs the vllm package") as raised:
        engine_check.run_engine(job, tmp_path, "target", "1", logging.getLogger("test"))
    assert "failed with exit 1" in str(raised.value) and not (tmp_path / "target-0.json").exists()
