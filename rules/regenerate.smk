# Optional: the target rewrites every assistant turn (per shard and the selection conversations, resumable).
# Tokenize reads the result.


rule regenerate:
    input:
        conversations=regenerate_input,
        target=TARGET_DIR,
    output:
        REGENERATED_SHARD,
    params:
        regenerate=regenerate_params,
        max_seq_len=config["data"]["max_seq_len"],
        trust_remote_code=config["target"]["trust_remote_code"],
    threads: config["regenerate"]["threads"]
    resources:
        gpu=config["regenerate"]["gpus"] if config["regenerate"]["engine"] != "openai" else 0,
        mem_mb=8000,
    conda:
        "../envs/vllm.yaml" if config["regenerate"]["engine"] == "vllm" else "../envs/pipeline.yaml"
    log:
        f"{LOGS}/regenerate/shard-{{shard}}.log",
    script:
        "../scripts/regenerate.py"
