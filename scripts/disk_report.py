"""Rule `disk_report`: planned (from exact token counts) vs actual bytes of every hidden-state store."""

from eagle3_pipeline.stages import disk_report

disk_report.run_from_snakemake(globals()["snakemake"])
