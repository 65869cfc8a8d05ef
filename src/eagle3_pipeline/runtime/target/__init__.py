"""The target model as every stage loads it (a converted HF directory: tokenizer, config, weights) and the
devices jobs run on."""
