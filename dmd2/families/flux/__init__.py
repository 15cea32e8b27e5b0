"""FLUX.1: a diffusers `FluxPipeline` teacher (FLUX.1 [dev], guidance-distilled) distilled into a few-step student.

On the pipeline families' base (dmd2/flow_pipeline/): what FLUX states is its pipeline's JSON and the time shift
its `mu` gives at a resolution (`pipeline`), how its transformer is called (`velocity`: 2 x 2 packing, `txt_ids` /
`img_ids`, timestep = sigma, the guidance input), and the family itself (`family`). FLUX.2 [klein]
(`Flux2KleinPipeline`) is the `flux2_klein` family in `klein/`, which reads the pipeline's files with `pipeline`.
Importing this package is cheap.
"""
