"""The model families: one package each (see `dmd2.family` for the contract and the registry)."""
