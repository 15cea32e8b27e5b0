"""FLUX.2 [klein]: a diffusers `Flux2KleinPipeline` teacher distilled into a few-step student (the `flux2_klein`
family, registered beside FLUX.1's `flux`: a family of its own, since its text encoder, latents, model call and time
shift all differ, kept in FLUX's folder to read the pipeline's files as FLUX.1 does).

What klein states on the pipeline families' base: its pipeline's JSON, its latent shape and the time shift its
empirical `mu` gives at a resolution and a step count (`pipeline`), its Qwen3 prompt table (`prompts`), how its
transformer is called (`velocity`), and the family itself (`family`). Importing this package is cheap.
"""
