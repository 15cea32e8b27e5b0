"""Wan 2.1 / 2.2: a diffusers `WanPipeline` teacher distilled into a few-step video transformer.

Building blocks, in the order a run uses them: check the teacher directory (`pipeline`: its JSON, the UniPC flow
scheduler's shift, the latent shape of a video), load its transformer or Wan 2.2 A14B's two experts as one model
(`experts`), encode the prompts once with its UMT5 (`prompts`), evaluate videos (`evaluation`), export the student
as a pipeline that the stock diffusers sampler runs exactly as the student's sampler (`export`), generate from it
(`generation`). Importing this package is cheap: the modules load on use.
"""
