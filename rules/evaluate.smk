# Evaluation: speculative decoding with the exported drafter vs baselines, then plots for the report.
# Two passes: `evaluate` (per prompt set, parallel workers) measures tau; `evaluate_timing` (one process,
# after every tau pass) measures speed.

import types

TIMING_RESULTS = LAYOUT.timing_results


rule evaluate:
    input:
        serving=SERVING_DIR,
        target=TARGET_DIR,
        prompts=prompt_file,
    output:
        report(
            EVAL_RESULTS,
            caption="../report/evaluation.rst",
            category="Evaluation",
            labels={"prompt set": "{prompt_set}", "kind": "results (JSON)"},
        ),
    params:
        settings=job_settings("evaluate"),
        trust_remote_code=config["target"]["trust_remote_code"],
    threads: config["evaluate"]["threads"]
    resources:
        gpu=1 if config["evaluate"]["device"] != "cpu" else 0,
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/evaluate/{{prompt_set}}.log",
    script:
        "../scripts/evaluate.py"


try:
    TIMING_SETS = workflow_config.chosen_sets(config, "evaluate.timing.prompt_sets", PROMPT_SETS)
except workflow_config.ConfigError as exc:
    sys.exit(f"Config error: {exc}")


rule evaluate_timing:
    input:
        serving=SERVING_DIR,
        target=TARGET_DIR,
        prompts=[prompt_file(types.SimpleNamespace(prompt_set=name)) for name in TIMING_SETS],
        tau_pass=expand(EVAL_RESULTS, prompt_set=PROMPT_SETS),  # after the tau pass: nothing else of ours runs
    output:
        report(
            TIMING_RESULTS,
            caption="../report/timing.rst",
            category="Evaluation",
            labels={"prompt set": "all", "kind": "timing pass (JSON)"},
        ),
    params:
        settings=job_settings("evaluate"),
        prompt_sets=TIMING_SETS,
        trust_remote_code=config["target"]["trust_remote_code"],
    threads: config["evaluate"]["threads"]
    resources:
        gpu=1 if config["evaluate"]["device"] != "cpu" else 0,
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/evaluate_timing.log",
    script:
        "../scripts/evaluate_timing.py"


rule plots:
    input:
        evaluations=expand(EVAL_RESULTS, prompt_set=PROMPT_SETS),
        timing=TIMING_RESULTS,
        metrics=TRAIN_METRICS,
        summary=TRAIN_SUMMARY,
        disk=DISK_REPORT,
        config=CONFIG_SNAPSHOT,
        target=TARGET_DIR,
        data_stats=VOCAB_STATS,
        engine_check=[LAYOUT.engine_check(config["engine_check"]["engine"])] if config["engine_check"]["enabled"] else [],
    output:
        acceptance=report(f"{PLOTS}/acceptance_by_position.png", caption="../report/acceptance.rst",
                          category="Evaluation", labels={"figure": "acceptance by position"}),
        tau=report(f"{PLOTS}/tau_and_speedup.csv", caption="../report/tau.rst", category="Evaluation",
                   labels={"figure": "tau and speedup table"}),
        training=report(f"{PLOTS}/training_curves.png", caption="../report/training.rst", category="Training",
                        labels={"figure": "loss and per-step accuracy"}),
        disk=report(f"{PLOTS}/disk_plan_vs_actual.png", caption="../report/disk.rst", category="Disk",
                    labels={"figure": "disk plan vs actual"}),
        provenance=report(f"{PLOTS}/provenance.json", caption="../report/provenance.rst", category="Provenance",
                          labels={"figure": "provenance"}),
        front_page=f"{PLOTS}/front_page.html",  # embedded by report/workflow.rst, the report's first page
    params:
        full_config=config,
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/plots.log",
    script:
        "../scripts/plots.py"
