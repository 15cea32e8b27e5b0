"""What the families of flow-matching transformer pipelines share (SD3, FLUX, Qwen-Image): a diffusers pipeline
directory or hub id read from its JSON (`files`), prompts encoded once by the pipeline's own `encode_prompt` into a
table that prompt indices look up (`prompts`), the family's frame of a run (`family`: resolve, prepare, bind, load,
export, generate), the evaluation of decoded pictures (`evaluation`, `judges`), and the export as a complete
pipeline whose scheduler samples as the student (`export`). A family states only how its pipeline differs: the
pipeline class, how its latents are shaped and normalised, packing and ids, the timestep's scale, how guidance
enters, how the time shift follows from the resolution.

Only `files` is imported by the families' light checks (standard library); the rest loads torch on use.
"""
