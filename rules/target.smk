# Materialise the target once as a plain HF directory (config, tokenizer, safetensors).


rule target:
    input:
        [SETTINGS.chat_template_file] if SETTINGS.chat_template_file else [],
    output:
        directory(TARGET_DIR),
    params:
        source=config["target"]["source"],
        gguf_file=config["target"]["gguf_file"],
        revision=config["target"]["revision"],
        trust_remote_code=config["target"]["trust_remote_code"],
        chat_template=config["target"]["chat_template"],
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/target.log",
    resources:
        mem_mb=4000,
    script:
        "../scripts/target.py"
