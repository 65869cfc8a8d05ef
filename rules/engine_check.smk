# Engine check (optional, engine_check.enabled): the exported drafter served by vLLM on the tau pass's prompts,
# its acceptance length beside the evaluator's. After the timing pass, so the two never time side by side.

ENGINE_CHECK = LAYOUT.engine_check(config["engine_check"]["engine"])
try:
    ENGINE_CHECK_SETS = workflow_config.chosen_sets(config, "engine_check.prompts", PROMPT_SETS)
except workflow_config.ConfigError as exc:
    sys.exit(f"Config error: {exc}")


rule engine_check:
    input:
        serving=SERVING_DIR,
        target=TARGET_DIR,
        prompts=[prompt_file(types.SimpleNamespace(prompt_set=name)) for name in ENGINE_CHECK_SETS],
        evaluations=expand(EVAL_RESULTS, prompt_set=ENGINE_CHECK_SETS),
        timing=TIMING_RESULTS,
    output:
        report(
            ENGINE_CHECK,
            caption="../report/engine_check.rst",
            category="Evaluation",
            labels={"prompt set": "all", "kind": "engine check (JSON)"},
        ),
    params:
        settings=job_settings("engine_check"),
        prompt_sets=ENGINE_CHECK_SETS,
        evaluated={key: config["evaluate"][key] for key in ("max_prompts", "multi_turn", "max_new_tokens",
                                                             "draft_lengths")},
        trust_remote_code=config["target"]["trust_remote_code"],
    threads: config["engine_check"]["threads"]
    resources:
        gpu=1,
    conda:
        "../envs/vllm.yaml"
    log:
        f"{LOGS}/engine_check.log",
    script:
        "../scripts/engine_check.py"
