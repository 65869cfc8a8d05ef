# Data stage: raw conversations -> normalized shards -> token shards -> draft vocabulary.


rule ingest:
    input:
        SETTINGS.data_inputs,
    output:
        shards=expand(CONVERSATION_SHARD, shard=SHARDS),
        eval=EVAL_CONVERSATIONS,
        selection=SELECTION_CONVERSATIONS,
        report=INGEST_REPORT,
    params:
        data=DATA_PARAMS,
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/ingest.log",
    script:
        "../scripts/ingest.py"


rule tokenize:
    input:
        conversations=tokenize_input,
        target=TARGET_DIR,
    output:
        directory(TOKEN_SHARD),
    params:
        data=DATA_PARAMS,
        trust_remote_code=config["target"]["trust_remote_code"],
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/tokenize/shard-{{shard}}.log",
    script:
        "../scripts/tokenize.py"


rule vocab:
    input:
        shards=expand(TOKEN_SHARD, shard=SHARDS),
        target=TARGET_DIR,
        ingest_report=INGEST_REPORT,
    output:
        vocab=DRAFT_VOCAB,
        stats=VOCAB_STATS,
    params:
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/vocab.log",
    script:
        "../scripts/vocab.py"
