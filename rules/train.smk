# Drafter training (1..N GPUs; torchrun when more than one) and export to a serving directory.


rule train:
    input:
        unpack(training_inputs),  # every store, or under a disk budget the last pass (rules/windows.smk)
        heldout=heldout_stores,
        vocab=DRAFT_VOCAB,
        target=TARGET_DIR,
    output:
        weights=DRAFTER_WEIGHTS,
        summary=TRAIN_SUMMARY,
        metrics=TRAIN_METRICS,
        config=CONFIG_SNAPSHOT,
    params:
        settings=job_settings("train"),
        state_dir=TRAIN_STATE,
        # only what shapes the drafter: editing e.g. `evaluate`, or a job's size, must not retrain
        provenance={"target": config["target"], "data": DATA_PARAMS, "vocab": config["vocab"],
                    "extract": job_settings("extract"), "train": job_settings("train")},
    threads: config["train"]["threads"]
    resources:
        gpu=config["train"]["gpus"],
        mem_mb=16000,
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/train.log",
    script:
        "../scripts/train.py"


rule export:
    input:
        weights=DRAFTER_WEIGHTS,
    output:
        directory(SERVING_DIR),
    params:
        dtype=config["export"]["dtype"],
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/export.log",
    script:
        "../scripts/export.py"
