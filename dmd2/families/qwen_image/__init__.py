"""Qwen-Image: a diffusers `QwenImagePipeline` teacher distilled into a few-step student.

On the pipeline families' base (dmd2/flow_pipeline/): what Qwen-Image states is its pipeline's JSON, its latent
shape and the time shift its `mu` gives at a resolution (`pipeline`), its Qwen2.5-VL prompt encoding into a padded
table with masks (`prompts`), and how its transformer is called, true CFG with norm rescaling included (`velocity`).
Importing this package is cheap.
"""
