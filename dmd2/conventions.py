"""The numbers that fix the conventions of docs/architecture.md §1, importable without torch: the SD3
family's teacher checks compare a scheduler config against them before anything heavy loads."""

TIMESTEP_SCALE = 1000.0  # the model's timestep t = TIMESTEP_SCALE * sigma (after any shift)
