# Hidden-state extraction: one job per token shard, each writing one zarr store atomically.


rule parity:
    input:
        tokens=TOKEN_SHARD.format(shard=SHARDS[0]),
        target=TARGET_DIR,
    output:
        PARITY_REPORT,
    params:
        extract=job_settings("extract"),
        parity=job_settings("parity"),
        trust_remote_code=config["target"]["trust_remote_code"],
    threads: config["parity"]["threads"]
    resources:
        gpu=0 if config["parity"]["device"] == "cpu" else max(1, config["extract"]["gpus"]),  # the fp32 reference
        mem_mb=8000,
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/parity.log",
    script:
        "../scripts/parity.py"


rule extract:
    input:
        unpack(lambda wildcards: {"parity": PARITY_REPORT} if config["parity"]["enabled"] else {}),
        tokens=TOKEN_SHARD,
        target=TARGET_DIR,
    output:
        directory(HIDDEN_STORE),
    params:
        extract=job_settings("extract"),
        trust_remote_code=config["target"]["trust_remote_code"],
    threads: config["extract"]["threads"]
    resources:
        gpu=config["extract"]["gpus"],
        disk_mb=hidden_store_mb,
        mem_mb=8000,
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/extract/shard-{{shard}}.log",
    script:
        "../scripts/extract.py"


rule disk_report:
    input:
        unpack(disk_report_inputs),  # the stores, or under a disk budget the passes' records (rules/windows.smk)
        tokens=expand(TOKEN_SHARD, shard=SHARDS),
    output:
        DISK_REPORT,
    params:
        compression=config["plan"]["expected_compression"],
        store_dtype=config["extract"]["store_dtype"],
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/disk_report.log",
    script:
        "../scripts/disk_report.py"
