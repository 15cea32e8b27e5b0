"""SD3 conditioning by prompt index: records carry `{"prompt_index": [B] int64}`, never embeddings.

A `PromptTable` holds the encoded prompts (dmd2/families/sd3/prompts.py: `encode_prompt_table`); it
expands indices into the keyword arguments of `SD3Transformer2DModel.forward`
(`encoder_hidden_states` [B, L, D], `pooled_projections` [B, Dp]), so that
`dmd2.model.DiffusersVelocity(transformer)(x_s, sigma, table.cond(index))` is the velocity.
`TableVelocity` does that expansion inside a `VelocityFn`, so the algorithm (rollout, CFG via
`dmd2.model.guided`, critic and actor steps) moves small index tensors around. The index
`NEGATIVE` (-1) stands for the negative prompt: CFG's negative branch is `negative_indices(B)`.
"""

from dmd2.flow_pipeline.prompts import PromptTable  # noqa: F401 (re-exported)
from dmd2.prompt_index import INDEX_KEY, NEGATIVE, TableVelocity, negative_indices, prompt_indices  # noqa: F401
