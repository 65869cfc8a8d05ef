"""The report's first page from hand-made results: per prompt set the best setting of each kind (fastest
measured, else highest tau), the verdict, the commands that serve the pick, the line on the run, the disk plan
against the bytes on disk, and a sentence for each measurement the run lacks."""

from __future__ import annotations

from html.parser import HTMLParser

from eagle3_pipeline.reporting import front_page, headline

TREE_SMALL, TREE_BIG = "eagle3-tree(steps=3,topk=1,tokens=4)", "eagle3-tree(steps=5,topk=8,tokens=32)"


def method(tau: float | None, k: int | None = None, flags: str = "") -> dict:
    values = {"prompts": 6, "tokens": 192}
    if tau is not None:
        values |= {"k": k, "tau": tau, "acceptance_by_position": [0.5] * (k or 1), "diverged_share": 0.0}
    return values | ({"sglang_flags": flags} if flags else {})


def timed(speedup: float, tokens_per_s: float | None = None) -> dict:
    return {"tokens_per_s": tokens_per_s or 100.0 * speedup, "speedup_vs_target": speedup, "draft_ms_per_step": 1.0,
            "verify_ms_per_step": 9.0, "prompts": 2}


def evaluations() -> dict:
    summary = {"target": method(None), "prompt-lookup@k=4": method(1.4, 4), "eagle3-untrained@k=4": method(1.0, 4),
               # the longer chain reaches a higher tau but is slower: the faster one is the pick
               "eagle3@k=4": method(2.2, 4, "--speculative-num-steps 4 --speculative-eagle-topk 1 "
                                           "--speculative-num-draft-tokens 5"),
               "eagle3@k=7": method(2.6, 7, "--speculative-num-steps 7 --speculative-eagle-topk 1 "
                                           "--speculative-num-draft-tokens 8"),
               TREE_SMALL: method(2.1, 3, "--speculative-num-steps 3 --speculative-eagle-topk 1 "
                                          "--speculative-num-draft-tokens 4"),
               TREE_BIG: method(2.9, 5, "--speculative-num-steps 5 --speculative-eagle-topk 8 "
                                        "--speculative-num-draft-tokens 32")}
    return {"mtbench-package": {"summary": summary}}


TIMING = {"device": "cuda", "device_name": "NVIDIA H200", "sets": {"mtbench-package": {
    "target": timed(1.0), "prompt-lookup@k=4": timed(1.25), "eagle3@k=4": timed(1.75), "eagle3@k=7": timed(1.5),
    TREE_SMALL: timed(1.6), TREE_BIG: timed(2.25)}}}
FACTS = front_page.RunFacts(run="smollm2-default", target="smollm2-gguf", conversations=160, tokens=41234,
                            epochs=2, steps=80, train_seconds=312.0, train_device="CPU, 2 threads",
                            eval_device="NVIDIA H200, float32", target_dir="results/smollm2-default/target",
                            drafter_dir="results/smollm2-default/serving/drafter")
DISK = {"shards": {"shard-00000.zarr": {}, "shard-00001.zarr": {}}, "planned_bytes": 120_000_000,
        "actual_bytes": 102_500_000, "actual_over_planned": 0.854}


class PageText(HTMLParser):
    """The fragment's table rows (cell texts) and paragraphs, as a browser would show their text."""

    def __init__(self, html: str):
        super().__init__()
        self.rows: list[list[str]] = []
        self.paragraphs: list[str] = []
        self.preformatted: list[str] = []
        self.where: str | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.rows[-1].append("")
        if tag in ("td", "th", "p", "pre", "style"):
            self.where = tag
        if tag == "p":
            self.paragraphs.append("")
        elif tag == "pre":
            self.preformatted.append("")

    def handle_endtag(self, tag):
        if tag in ("td", "th", "p", "pre", "style"):
            self.where = None

    def handle_data(self, data):  # inline tags (code, span, b) stay inside their cell or paragraph
        if self.where in ("td", "th"):
            self.rows[-1][-1] += data
        elif self.where == "p":
            self.paragraphs[-1] += data
        elif self.where == "pre":
            self.preformatted[-1] += data


def page(evaluations_: dict, timing: dict) -> PageText:
    return PageText(front_page.front_page(evaluations_, timing, FACTS, DISK))


def test_the_table_holds_the_fastest_setting_of_each_kind_and_the_verdict_names_the_pick():
    shown = page(evaluations(), TIMING)
    rows = {row[0].split(":")[0]: row[1:] for row in shown.rows if len(row) == 4}
    assert rows["target alone"] == ["1.000", "1.00x", "100.0"]
    assert rows["EAGLE-3 chain"] == ["2.200", "1.75x", "175.0"]  # k=4: faster than k=7 despite the lower tau
    assert rows["EAGLE-3 tree"] == ["2.900", "2.25x", "225.0"]
    settings = [row[0] for row in shown.rows if row[0].startswith("EAGLE-3")]
    assert settings == ["EAGLE-3 chain: eagle3@k=4", "EAGLE-3 tree: " + TREE_BIG]
    assert shown.paragraphs[0] == (f"mtbench-package: Serve: {TREE_BIG}, tau 2.90: 2.25x the target alone, 1.80x "
                                   "prompt lookup's speed (prompt lookup: 1.25x).")


def test_the_commands_serve_the_pick_with_sglang_and_the_best_chain_with_vllm():
    sglang, vllm = page(evaluations(), TIMING).preformatted
    assert sglang == ("python -m sglang.launch_server --model-path results/smollm2-default/target "
                      "--speculative-algorithm EAGLE3 --speculative-draft-model-path "
                      "results/smollm2-default/serving/drafter --speculative-num-steps 5 --speculative-eagle-topk 8 "
                      "--speculative-num-draft-tokens 32")
    assert vllm == ("vllm serve results/smollm2-default/target --speculative-config '{\"method\": \"eagle3\", "
                    "\"model\": \"results/smollm2-default/serving/drafter\", \"num_speculative_tokens\": 4}'")


def test_the_run_and_disk_lines_and_the_missing_engine_check_are_said():
    paragraphs = page(evaluations(), TIMING).paragraphs
    assert ("Run smollm2-default: target smollm2-gguf; 160 training conversations (41,234 tokens); 2 epochs, 80 "
            "steps, trained in 5.2 min on CPU, 2 threads; evaluated on NVIDIA H200, float32.") in paragraphs
    assert ("Disk: the plan gave the hidden-state stores 120.0 MB; they hold 102.5 MB on disk (0.85 of the plan, "
            "2 stores).") in paragraphs
    assert any(p.startswith("Engine check: none in this run") for p in paragraphs)
    assert not any(p.startswith("Timing pass") for p in paragraphs)


def test_without_a_timing_pass_the_page_says_so_and_picks_by_tau():
    shown = page(evaluations(), {})
    rows = {row[0].split(":")[0]: row[1:] for row in shown.rows if len(row) == 4}
    assert rows["EAGLE-3 chain"] == ["2.600", "not timed", "not timed"]  # k=7: the higher tau
    assert shown.paragraphs[0] == (f"mtbench-package: Not timed: {TREE_BIG}, tau 2.90 (the highest tau); the timing "
                                   "pass did not time it, so its speed is unknown.")
    assert any(p.startswith("Timing pass: none in this run, so no speeds") for p in shown.paragraphs)
    assert ["mtbench-package (6 prompts, no timing pass)"] in shown.rows


def test_the_verdict_says_when_decoding_without_a_drafter_or_prompt_lookup_is_faster():
    slow = {"sets": {"mtbench-package": {name: timed(speedup) for name, speedup in (
        ("target", 1.0), ("prompt-lookup@k=4", 1.1), ("eagle3@k=4", 0.5), (TREE_BIG, 0.6))}}}
    line = headline.headlines(evaluations(), slow)[0]
    assert headline.verdict(line) == ("Not faster here", (
        f"{TREE_BIG}, tau 2.90: 0.60x the target alone, 0.55x prompt lookup's speed (prompt lookup: 1.10x); "
        "decoding without a drafter is faster"))
    assert headline.fastest(line).method == "prompt-lookup@k=4"
    copying = {"sets": {"mtbench-package": {"target": timed(1.0), "prompt-lookup@k=4": timed(1.5),
                                            "eagle3@k=4": timed(1.25)}}}
    line = headline.headlines(evaluations(), copying)[0]
    assert headline.verdict(line)[0] == "Prompt lookup is faster here"
    assert line.best["EAGLE-3 tree"].method == TREE_BIG and line.best["EAGLE-3 tree"].speedup is None


def test_an_engine_check_is_said_with_its_verdict_instead_of_its_absence():
    figures = {"engine_acceptance_length": 1.747, "evaluator_acceptance_length": 1.738, "gap": 0.0052,
               "judged_on": "64 same-text prompts", "identical_share": 1.0, "speedup_vs_target": 1.91}
    check = {"engine": "vllm", "engine_version": "0.26.0", "dtype": "bfloat16", "cuda_graphs": True, "passed": True,
             "sets": {"mtbench-package": {"methods": {"eagle3@k=4": figures}}}}
    paragraphs = PageText(front_page.front_page(evaluations(), TIMING, FACTS, DISK, check)).paragraphs
    assert ("Engine check (vllm 0.26.0, bfloat16, CUDA graphs): passed - acceptance length in the engine vs this "
            "pipeline's evaluator, mtbench-package eagle3@k=4: 1.747 vs 1.738 (+0.5% on 64 same-text prompts), 100% "
            "of outputs identical to its target alone, 1.91x its target alone.") in paragraphs
    assert not any(p.startswith("Engine check: none") for p in paragraphs)
    failed = PageText(front_page.front_page(evaluations(), TIMING, FACTS, DISK, check | {"passed": False}))
    assert any("FAILED" in p for p in failed.paragraphs)


def test_each_prompt_set_gets_the_fastest_sglang_setting_and_vllm_chain_with_tau_speed_and_step_times():
    two_sets = evaluations() | {"held-out": evaluations()["mtbench-package"]}
    timing = {"sets": TIMING["sets"] | {"held-out": {"target": timed(1.0), "eagle3@k=4": timed(1.2),
                                                     "eagle3@k=7": timed(1.4), TREE_BIG: timed(1.1)}}}
    rows = {tuple(row[:2]): row[2:] for row in page(two_sets, timing).rows if len(row) == 6}
    assert rows["mtbench-package", "SGLang"] == ["--speculative-num-steps 5 --speculative-eagle-topk 8 "
                                                 "--speculative-num-draft-tokens 32", "2.900", "2.25x", "1.00 / 9.00"]
    assert rows["mtbench-package", "vLLM"] == ['"num_speculative_tokens": 4', "2.200", "1.75x", "1.00 / 9.00"]
    # on held-out the longer chain is the fastest setting of all: SGLang serves it too
    assert rows["held-out", "SGLang"][:3] == ["--speculative-num-steps 7 --speculative-eagle-topk 1 "
                                              "--speculative-num-draft-tokens 8", "2.600", "1.40x"]
    assert rows["held-out", "vLLM"][:3] == ['"num_speculative_tokens": 7', "2.600", "1.40x"]
    untimed = {tuple(row[:2]): row[2:] for row in page(evaluations(), {}).rows if len(row) == 6}
    assert untimed["mtbench-package", "SGLang"][2:] == ["not timed", "not timed"]  # picked by tau
